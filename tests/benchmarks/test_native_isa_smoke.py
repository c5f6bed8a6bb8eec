"""`benchmarks/native_isa.py --quick`: every ISA this CPU runs, each in its own child process, one round on a
small layer (timings are not asserted; only that each child ran the ISA it was asked for, and the report)."""

from __future__ import annotations

import pytest
from support.benchmark_run import run_quick

from tutel_jax.native import _build as build

needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler: the native "
                                                                                   "kernels cannot be built here")


@needs_compiler
def test_native_isa_quick(tmp_path):
    out = tmp_path / "native_isa.json"
    result = run_quick("native_isa", out, timeout_s=600)
    assert list(result["isas"]) == list(build.cpu_isas())  # best first, portable last
    for isa, runs in result["per_round"].items():
        assert [run["isa"] for run in runs] == [isa]
    best = next(iter(result["isas"].values()))["int8"]  # the best path: the best ISA, int8 activations
    assert all(v["ratio_to_best"] == 1.0 for v in best.values())
    for per in result["isas"].values():
        assert set(per) == {"int8", "float32"}
        for by_tokens in per.values():
            assert set(by_tokens) == {"1", "8", "32"}
            assert all(v["seconds"] > 0 and v["gb_per_s"] > 0 for v in by_tokens.values())
    text = out.with_suffix(".md").read_text()
    assert "| portable | int8 | 1 |" in text and "| portable | float32 | 1 |" in text
