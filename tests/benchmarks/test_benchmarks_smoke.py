"""The benchmark scripts run end to end (tiny sizes) and write their result files; timings are not asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.xla_flags import with_fast_compile
from support.paths import REPO



def _run(script: str, out: Path) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=with_fast_compile("--xla_force_host_platform_device_count=8"))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--quick", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.with_suffix(".md").read_text().count("|") > 10
    return json.loads(out.read_text())


def test_moe_layer_benchmark_quick(tmp_path):
    result = _run("moe_layer.py", tmp_path / "moe_layer.json")
    assert "checks" in result and result["machine"]["backend"] == "cpu"


def test_expert_parallel_benchmark_quick(tmp_path):
    result = _run("expert_parallel.py", tmp_path / "ep.json")
    assert set(result["timings"]) >= {"1 device", "EP 8 (flat)", "EP 8, 2DH (2x4)"}
    assert all(t["median_s"] > 0 for t in result["timings"].values())


def test_serve_benchmark_quick(tmp_path):
    result = _run("serve.py", tmp_path / "serve.json")
    assert result


def test_server_soak_benchmark_quick(tmp_path):
    """Good clients are all answered while hostile ones run, and every hostile request got its expected answer
    (the script exits non-zero otherwise)."""
    result = _run("server_soak.py", tmp_path / "soak.json")
    assert result["passed"] and result["server_alive"] and result["server_tracebacks"] == 0
    hostile = result["phases"]["hostile"]
    assert hostile["good_requests"] > 0 and hostile["good_failures"] == 0 and hostile["p99_ms"] > 0
    assert set(hostile["hostile"]) >= {"nested", "huge", "huge_header", "truncated", "slow_loris", "unknown_model"}
    assert hostile["hostile"]["slow_loris"] == {"408": hostile["hostile"]["slow_loris"]["408"]}
