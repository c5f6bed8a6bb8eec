"""The machine's streaming read bandwidth: the roofline of a bandwidth-bound CPU kernel (decode reads every used
weight once per token).

    read_bandwidth(nbytes=1 GiB, threads=None, reps=5) -> bytes per second
    probe = ReadProbe(nbytes, threads); probe() -> bytes per second of one more read of the same buffer

`threads` threads (default: this process's usable CPUs) each read one contiguous slice of one buffer with vector
loads and the kernels' software prefetch of a stream (`read_bandwidth.cc`, built like the other native kernels;
on one AMD Zen 3 host a decode step's kernels at times read a little faster than it); the best of `reps` passes
counts. The buffer is
larger than any cache, so the figure is DRAM's, as a multi-threaded kernel sees it: a copy bandwidth (read plus
write, one core) understates it. On a shared host the figure moves with the neighbours' traffic (13-28 GB/s
within minutes on one 2-core cloud machine): `ReadProbe` keeps its buffer, so that reads can be interleaved with
the steps they are the roofline of (a read after each decode step: both measured at the same moments).
"""

from __future__ import annotations

import ctypes

import numpy as np

from ..core import empty_aligned, usable_cpus
from ..validation import check_int
from ._build import load

__all__ = ["ReadProbe", "read_bandwidth", "read_words"]

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


class ReadProbe:
    """A buffer of `nbytes` (rounded down to whole 64-byte lines) read by `threads` threads (default: this
    process's usable CPUs) on each call: bytes per second of the best of `reps` passes. RuntimeError if the
    kernel did not read every word."""

    def __init__(self, nbytes: int = 1 << 30, threads: int | None = None):
        check_int(nbytes, "nbytes", minimum=64)
        check_int(threads, "threads", minimum=1, optional=True)
        nbytes -= nbytes % 64
        self.threads = threads or usable_cpus()
        self.words = empty_aligned((nbytes // 8,), np.uint64)
        self.words[:] = 0  # touches every page
        self.words[-1] = _PATTERN  # the last thread's last word

    def __call__(self, reps: int = 1) -> float:
        check_int(reps, "reps", minimum=1)
        seconds, seen = read_words(self.words, self.threads, reps)
        if seen != _PATTERN:
            raise RuntimeError(f"the read kernel saw {seen:#x}, expected {_PATTERN:#x}")
        return self.words.nbytes / seconds


def read_bandwidth(nbytes: int = 1 << 30, threads: int | None = None, reps: int = 5) -> float:
    """Bytes per second of the best of `reps` multi-threaded reads of an `nbytes` buffer (`ReadProbe`)."""
    return ReadProbe(nbytes, threads)(reps)
