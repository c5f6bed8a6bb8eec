"""benchmarks/generate.py runs end to end in its quick mode (tiny model, tutel-jax only) and writes its result
files; timings are not asserted beyond being positive. One batch size keeps the compiles (prefill, decode step,
two on-device programs, for each of the two MoE implementations) to a few seconds of CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tutel_jax.native._build import compiler
from support.paths import REPO



def test_generate_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "generate.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, str(REPO / "benchmarks" / "generate.py"), "--quick", "--no-hf", "--batch", "2",
           "--out", str(out)]
    proc = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["benchmark"] == "generate" and result["quick"] is True
    assert result["hf"]["skipped"]  # --no-hf: tutel-jax alone, and the report says why
    assert result["settings"]["model"]["experts"] > 1 and result["num_params"] > 0
    assert result["machine"]["cpu_count"] >= 1
    assert [r["batch"] for r in result["results"]] == result["settings"]["batches"]
    # both MoE implementations, each in both modes, generate the same greedy tokens (without a C++ compiler the
    # native kernel cannot be built: the report says so and the XLA path is measured alone)
    impls = ("native", "auto") if compiler() is not None else ("auto",)
    assert result["tutel_dropless_impls"] == {i: i for i in impls}
    assert ("native" in result["unavailable_dropless_impls"]) == (len(impls) == 1)
    for row in result["results"]:
        variants = {f"tutel_{i}_{m}" for i in impls for m in ("host", "device")}
        assert set(row["systems"]) == variants and "tutel_" + row["tutel_best"] in variants
        assert row["token_mismatches_between_variants"] == 0
        for stats in row["systems"].values():
            assert stats["generate_tok_s"] > 0 and stats["time_s"] > 0 and stats["prefill_s"] > 0
        assert row["tutel"]["generate_tok_s"] == max(s["generate_tok_s"] for s in row["systems"].values())
        assert set(row["tutel_by_impl"]) == set(impls)
        assert "hf" not in row and "ratio_generate" not in row
    text = out.with_suffix(".md").read_text()
    assert "tutel-jax tok/s" in text and "HF skipped" in text and text.count("|") > 10
