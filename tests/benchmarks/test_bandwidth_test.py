"""Tests of `examples/bandwidth_test.py`: a subprocess run on 8 forced CPU devices with tiny sizes, flag errors,
and one in-process `main()` call on a 6-device (2, 3) mesh."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import REPO

SCRIPT = REPO / "examples" / "bandwidth_test.py"
TIMEOUT_S = 180
OPS = ("all_to_all", "all_to_all_2dh", "all_gather", "all_reduce", "reduce_scatter")


def run_script(*args: str) -> subprocess.CompletedProcess:
    """Runs the script on 8 fake CPU devices and returns the finished process."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def test_tiny_run_checks_and_writes_json(tmp_path: Path) -> None:
    out_json = tmp_path / "results" / "bw.json"
    proc = run_script("--size_mb", "1", "--loop", "2", "--warmup", "1", "--json", str(out_json))
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    out = proc.stdout
    assert "check: ok" in out, out
    assert "jax " in out and "backend = cpu" in out and "devices = 8" in out, out
    assert "2DH mesh (node, local) = (2, 4)" in out, out  # default node size for 8 devices
    for op in OPS:
        assert any(line.split()[:1] == [op] for line in out.splitlines()), f"no table row for {op}:\n{out}"

    report = json.loads(out_json.read_text())
    assert report["num_devices"] == 8 and report["backend"] == "cpu" and report["check"] == "ok"
    assert report["mesh_2dh"] == [2, 4] and report["node_size"] == 4
    assert report["bytes_per_device"] == 1 << 20
    assert report["buffer_shape"][0] == 8  # one expert per device
    assert sorted(report["results"]) == sorted(OPS)
    for op, res in report["results"].items():
        assert res["bytes"] == 1 << 20, (op, res)
        assert len(res["times_ms"]) == 2, (op, res)
        for field in ("time_ms", "algbw_gbps", "busbw_gbps"):
            assert math.isfinite(res[field]) and res[field] > 0, (op, field, res)
        assert res["algbw_gbps"] == pytest.approx(res["bytes"] / (res["time_ms"] * 1e-3) * 1e-9)
        factor = (2.0 if op == "all_reduce" else 1.0) * 7 / 8
        assert res["bus_factor"] == pytest.approx(factor)
        assert res["busbw_gbps"] == pytest.approx(res["algbw_gbps"] * factor)


@pytest.mark.parametrize("args, message", [
    (("--node_size", "3"), "--node_size: 3 does not divide the device count 8"),
    (("--size_mb", "0"), "--size_mb: must be > 0"),
    (("--devices", "9"), "--devices: 9 requested but only 8 available"),
])
def test_bad_flags_exit_with_an_error_line(args: tuple[str, ...], message: str) -> None:
    proc = run_script(*args)
    assert proc.returncode != 0, proc.stdout
    assert "error:" in proc.stderr and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "check: ok" not in proc.stdout


def test_main_in_process_on_a_2x3_mesh() -> None:
    """main() on 6 of the 8 test devices (conftest), a (2, 3) 2DH mesh and bfloat16: checks pass, dict returned."""
    import jax

    if jax.device_count() < 6:
        pytest.skip(f"needs 6 devices, have {jax.device_count()}")
    spec = importlib.util.spec_from_file_location("bandwidth_test_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = module.main(["--devices", "6", "--node_size", "3", "--dtype", "bfloat16", "--size_mb", "0.5",
                          "--loop", "1", "--warmup", "0"])
    assert report["check"] == "ok" and report["num_devices"] == 6 and report["mesh_2dh"] == [2, 3]
    num_experts, cap, dim = report["buffer_shape"]
    assert num_experts == 6 and report["bytes_per_device"] == num_experts * cap * dim * 2 <= (1 << 19)
    assert sorted(report["results"]) == sorted(OPS)
    assert all(res["algbw_gbps"] > 0 for res in report["results"].values())
