"""benchmarks/dropless.py runs end to end at tiny sizes and writes its result files; timings are not asserted."""

from __future__ import annotations

from support.benchmark_run import run_quick


def test_dropless_benchmark_quick(tmp_path):
    out = tmp_path / "dropless.json"
    result = run_quick("dropless", out)
    assert out.with_suffix(".md").read_text().count("|") > 10
    for case in result["cases"]:
        assert set(case["forward"]) == {"capacity", "ragged", "bucketed"}
        assert case["max_abs_bucketed_minus_ragged"] < 1e-5  # both dropless: the same outputs
        assert case["stats"]["ragged"]["dropped_fraction"] == case["stats"]["bucketed"]["dropped_fraction"] == 0
