"""benchmarks/autotune.py runs end to end at tiny sizes (--quick) and writes its result files. Timings are not
asserted; the structure is: the tuner's choice is the fastest median of its own measurements, and the side-by-side
table times the tuned, default and slowest configurations."""

from __future__ import annotations

from support.benchmark_run import run_quick


def test_autotune_benchmark_quick(tmp_path):
    out = tmp_path / "autotune.json"
    result = run_quick("autotune", out, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    markdown = out.with_suffix(".md").read_text()
    assert markdown.count("|") > 10 and "Decision log" in markdown
    report = result["autotune"]
    medians = {m["label"]: m["median_s"] for m in report["measurements"]}
    assert len(medians) == len(result["candidates"]) == 3
    assert medians[report["label"]] == min(medians.values())
    assert [e["event"] for e in result["decision_log"]] == ["measure"] * 3 + ["choose"]
    assert all(e["compile_s"] >= 0 and e["runs"] == 2 for e in result["decision_log"])
    roles = sorted(r for row in result["side_by_side"] for r in row["roles"])
    assert roles == ["default", "tuned", "worst"]
    tuned = next(row for row in result["side_by_side"] if "tuned" in row["roles"])
    assert tuned["ratio_to_tuned"] == 1.0 and all(row["median_s"] > 0 for row in result["side_by_side"])
    assert result["side_by_side_compiles"] == 0  # the forks reuse the tuning's compiled steps
    assert report["band"] is not None  # bounded dropless (cf < 0): the capacity follows the routing: a band
