"""benchmarks/dropless.py runs end to end at tiny sizes and writes its result files; timings are not asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_dropless_benchmark_quick(tmp_path):
    out = tmp_path / "dropless.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "dropless.py"), "--quick", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert out.with_suffix(".md").read_text().count("|") > 10
    for case in result["cases"]:
        assert set(case["forward"]) == {"capacity", "ragged", "bucketed"}
        assert case["max_abs_bucketed_minus_ragged"] < 1e-5  # both dropless: the same outputs
        assert case["stats"]["ragged"]["dropped_fraction"] == case["stats"]["bucketed"]["dropped_fraction"] == 0
