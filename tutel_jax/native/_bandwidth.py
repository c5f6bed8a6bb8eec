"""The machine's streaming read bandwidth: the roofline of a bandwidth-bound CPU kernel (decode reads every used
weight once per token).

    read_bandwidth(nbytes=1 GiB, threads=None, reps=5) -> bytes per second

`threads` threads (default: this process's usable CPUs) each read one contiguous slice of one buffer with vector
loads and the kernels' software prefetch of a stream (`read_bandwidth.cc`, built like the other native kernels:
a read at its best, which no kernel outruns); the best of `reps` passes counts. The buffer is
larger than any cache, so the figure is DRAM's, as a multi-threaded kernel sees it: a copy bandwidth (read plus
write, one core) understates it.
"""

from __future__ import annotations

import ctypes

import numpy as np

from ..core import empty_aligned, usable_cpus
from ..validation import check_int
from ._build import load

__all__ = ["read_bandwidth", "read_words"]

_PATTERN = 0x0102040810204080  # one bit per byte lane: the OR of every word proves every word was read


def read_words(words: np.ndarray, threads: int, reps: int = 1) -> tuple[float, int]:
    """(best seconds of `reps` reads of `words` by `threads` threads, the OR of all its words): uint64 words
    [n], C-contiguous, n * 8 a multiple of 64."""
    if words.dtype != np.uint64 or words.ndim != 1 or not words.flags.c_contiguous or (words.size * 8) % 64:
        raise ValueError(f"words must be C-contiguous uint64 [n] with n a multiple of 8, got {words.dtype} "
                         f"{words.shape}")
    fn = load("read_bandwidth").tutel_read_seconds
    fn.restype = ctypes.c_double
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_uint64)]
    seen = ctypes.c_uint64(0)
    seconds = fn(words.ctypes.data, words.size * 8, threads, reps, ctypes.byref(seen))
    return seconds, seen.value


def read_bandwidth(nbytes: int = 1 << 30, threads: int | None = None, reps: int = 5) -> float:
    """Bytes per second of the best of `reps` multi-threaded reads of an `nbytes` buffer (rounded down to whole
    64-byte lines). RuntimeError if the kernel did not read every word."""
    check_int(nbytes, "nbytes", minimum=64)
    check_int(threads, "threads", minimum=1, optional=True)
    check_int(reps, "reps", minimum=1)
    nbytes -= nbytes % 64
    words = empty_aligned((nbytes // 8,), np.uint64)
    words[:] = 0  # touches every page
    words[-1] = _PATTERN  # the last thread's last word
    seconds, seen = read_words(words, threads or usable_cpus(), reps)
    if seen != _PATTERN:
        raise RuntimeError(f"the read kernel saw {seen:#x}, expected {_PATTERN:#x}")
    return nbytes / seconds
