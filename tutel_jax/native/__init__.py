"""Native CPU kernels (C++ through XLA FFI), compiled on first use: see `build`, `moe` (the routed experts of a
MoE layer, float or packed) and `dense` (a linear layer for a few rows)."""

from .build import NativeKernelError
from .dense import dense
from .moe import moe_experts, moe_swiglu

__all__ = ["NativeKernelError", "dense", "moe_experts", "moe_swiglu"]
