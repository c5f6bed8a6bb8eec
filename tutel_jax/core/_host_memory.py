"""The host: arrays that JAX adopts without a copy, and the CPUs this process may use.

On the CPU backend, `jax.device_put` of a NumPy array whose data is 64-byte aligned (and contiguous, of the
target dtype) makes the device buffer an alias of the array's memory instead of a copy; NumPy's own large
allocations are only 16-byte aligned. Loading a checkpoint into arrays from `empty_aligned` therefore holds each
weight once, not twice, while it is put on the device (the array must not be written after that).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
from typing import Any

import jax
import numpy as np

__all__ = ["ALIGNMENT", "HUGE_PAGE", "HUGE_MIN_BYTES", "collapse_to_huge_pages", "empty_aligned", "usable_cpus"]

#: XLA:CPU's minimum buffer alignment for adopting host memory
ALIGNMENT = 64
#: a transparent huge page (x86-64 and AArch64 with 4 KiB base pages)
HUGE_PAGE = 2 << 20
#: arrays from this size on get a huge-page mapping of their own (smaller ones stay in malloc's arenas)
HUGE_MIN_BYTES = 2 * HUGE_PAGE
_MADV_COLLAPSE = 25  # linux/mman.h; not in Python's mmap module before 3.13
_HUGE_PAGES = sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE")


def empty_aligned(shape: tuple[int, ...] | int, dtype: Any) -> np.ndarray:
    """An uninitialized C-contiguous array whose data (when not empty) starts on an ALIGNMENT-byte boundary."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if _HUGE_PAGES and nbytes >= HUGE_MIN_BYTES:
        return _empty_on_huge_pages(nbytes).view(dtype).reshape(shape)
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _empty_on_huge_pages(nbytes: int) -> np.ndarray:
    """uint8 [nbytes] starting on a HUGE_PAGE boundary of a private anonymous mapping marked MADV_HUGEPAGE (the
    mapping is unmapped with the last array that views it). Pages are only touched by the caller's writes."""
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(area, np.uint8)
    start = (-raw.ctypes.data) % HUGE_PAGE  # a multiple of the base page: mappings start on one
    try:
        area.madvise(mmap.MADV_HUGEPAGE, start, len(area) - start)
    except OSError:  # THP disabled in this kernel: plain pages, still aligned
        pass
    return raw[start:start + nbytes]


def collapse_to_huge_pages(tree: Any) -> int:
    """Asks the kernel to back the whole 2 MiB pages of every array leaf of `tree` (NumPy, or JAX arrays on the
    CPU) of at least HUGE_MIN_BYTES with transparent huge pages now (MADV_COLLAPSE: a synchronous copy of what is
    still on 4 KiB pages, nothing for what is already huge). Best effort: returns the bytes asked for, 0 where
    the platform has no such call; a range the kernel cannot collapse (no free huge page) stays as it was."""
    if not _HUGE_PAGES:
        return 0
    madvise = _libc_madvise()
    asked = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        if getattr(leaf, "nbytes", 0) < HUGE_MIN_BYTES:
            continue
        if isinstance(leaf, np.ndarray):
            address = leaf.ctypes.data
        elif isinstance(leaf, jax.Array) and [d.platform for d in leaf.devices()] == ["cpu"]:  # one CPU buffer
            address = leaf.unsafe_buffer_pointer()
        else:
            continue
        lo = -(-address // HUGE_PAGE) * HUGE_PAGE
        hi = (address + leaf.nbytes) // HUGE_PAGE * HUGE_PAGE
        if hi > lo:
            madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_COLLAPSE)  # an error leaves it as it was
            asked += hi - lo
    return asked


def _libc_madvise() -> Any:
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask), at least 1."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):  # pragma: no cover - platforms without affinity masks
        return max(os.cpu_count() or 1, 1)
