"""Host arrays that JAX adopts without a copy.

On the CPU backend, `jax.device_put` of a NumPy array whose data is 64-byte aligned (and contiguous, of the
target dtype) makes the device buffer an alias of the array's memory instead of a copy; NumPy's own large
allocations are only 16-byte aligned. Loading a checkpoint into arrays from `empty_aligned` therefore holds each
weight once, not twice, while it is put on the device (the array must not be written after that).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["ALIGNMENT", "empty_aligned"]

#: XLA:CPU's minimum buffer alignment for adopting host memory
ALIGNMENT = 64


def empty_aligned(shape: tuple[int, ...] | int, dtype: Any) -> np.ndarray:
    """An uninitialized C-contiguous array whose data (when not empty) starts on an ALIGNMENT-byte boundary."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)
