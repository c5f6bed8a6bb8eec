"""The host: arrays that JAX adopts without a copy, and the CPUs this process may use.

On the CPU backend, `jax.device_put` of a NumPy array whose data is 64-byte aligned (and contiguous, of the
target dtype) makes the device buffer an alias of the array's memory instead of a copy; NumPy's own large
allocations are only 16-byte aligned. Loading a checkpoint into arrays from `empty_aligned` therefore holds each
weight once, not twice, while it is put on the device (the array must not be written after that).
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

__all__ = ["ALIGNMENT", "empty_aligned", "usable_cpus"]

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


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask), at least 1."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):  # pragma: no cover - platforms without affinity masks
        return max(os.cpu_count() or 1, 1)
