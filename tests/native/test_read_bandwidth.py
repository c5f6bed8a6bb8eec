"""The streaming-read probe reads every word of its buffer, whatever the thread count, and reports a rate."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest

from tutel_jax.native._bandwidth import ReadProbe, read_bandwidth, read_words


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_every_word_is_read(threads):
    words = np.zeros(8 * 1000 + 8, np.uint64)  # slices that do not divide evenly
    for position in (0, 1, 8 * 333 + 5, words.size // 2, words.size - 9, words.size - 1):
        words[:] = 0
        bit = np.uint64(1) << np.uint64(position % 64)
        words[position] = bit
        _, seen = read_words(words, threads)
        assert seen == int(bit), (position, threads)
    words[:] = np.arange(words.size, dtype=np.uint64) & np.uint64(0xFF)
    assert read_words(words, threads, reps=2)[1] == int(np.bitwise_or.reduce(words))


def test_portable_build_reads_every_word_too(tmp_path):
    """The portable build (TUTEL_JAX_NATIVE_ISA=portable, as on CPUs without AVX2 or NEON), in a fresh process."""
    code = ("import numpy as np\nfrom tutel_jax.native._bandwidth import read_words\n"
            "w = np.zeros(8 * 100 + 8, np.uint64); w[-1] = 5; w[3] = 8\n"
            "print(read_words(w, 3)[1])\n")
    env = {**os.environ, "TUTEL_JAX_NATIVE_ISA": "portable", "TUTEL_JAX_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "13"
    assert any(tmp_path.glob("read_bandwidth-*.so"))


def test_read_bandwidth_reports_a_rate():
    rate = read_bandwidth(16 << 20, threads=2, reps=2)
    assert math.isfinite(rate) and rate > 0


def test_bad_buffers_are_refused():
    with pytest.raises(ValueError, match="multiple of 8"):
        read_words(np.zeros(12, np.uint64), 1)
    with pytest.raises(ValueError, match="uint64"):
        read_words(np.zeros(16, np.float64), 1)


def test_read_probe_reads_its_buffer_on_every_call():
    probe = ReadProbe(16 << 20, threads=2)
    rates = [probe() for _ in range(3)] + [probe(reps=2)]
    assert all(math.isfinite(r) and r > 0 for r in rates)
    assert probe.words.nbytes == 16 << 20 and probe.threads == 2
    probe.words[-1] = 0  # the pattern the last thread must see is gone: the read is refused
    with pytest.raises(RuntimeError, match="read kernel saw"):
        probe()
