"""Native CPU kernels (C++ through XLA FFI), compiled on first use: see `build` and `moe_swiglu`."""

from .build import NativeKernelError
from .moe_swiglu import moe_swiglu

__all__ = ["NativeKernelError", "moe_swiglu"]
