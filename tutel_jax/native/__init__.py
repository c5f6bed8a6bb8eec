"""Native CPU kernels (C++ through XLA FFI), compiled on first use for the instruction set in effect (`isa()`:
AVX-512, AVX2, NEON or portable C++; `TUTEL_JAX_NATIVE_ISA` forces one): see `build`, `moe` (the routed experts
of a MoE layer, float or packed), `dense` (a linear layer for a few rows; bfloat16 weights also in 12 bits,
`compact_bf16`) and `attention` (one decode step of attention over a static KV cache)."""

from ._build import NativeKernelError, isa, isa_in_effect
from ._dense import compact_pays_off, dense, worth_it
from ._compact_bf16 import CompactBf16, compact_bf16
from ._moe import moe_experts, ensure_registered
from ._bandwidth import ReadProbe, read_bandwidth
from ._weights import int8_by_default
from ._attention import ATTENTION_IMPLS, attends_natively, check_attention_impl, decode_attention

__all__ = ["CompactBf16", "compact_bf16", "compact_pays_off", "ATTENTION_IMPLS", "attends_natively",
           "check_attention_impl", "decode_attention", "ensure_registered", "int8_by_default", "isa_in_effect",
           "ReadProbe", "read_bandwidth", "worth_it", "NativeKernelError", "dense", "isa", "moe_experts"]
