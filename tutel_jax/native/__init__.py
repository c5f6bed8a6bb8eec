"""Native CPU kernels (C++ through XLA FFI), compiled on first use for the instruction set in effect (`isa()`:
AVX-512, AVX2, NEON or portable C++; `TUTEL_JAX_NATIVE_ISA` forces one): see `build`, `moe` (the routed experts
of a MoE layer, float or packed), `dense` (a linear layer for a few rows) and `attention` (one decode step of
attention over a static KV cache)."""

from .build import NativeKernelError, isa
from .dense import dense
from .moe import moe_experts, moe_swiglu

__all__ = ["NativeKernelError", "dense", "isa", "moe_experts", "moe_swiglu"]
