"""benchmarks/gpu_kernels.py imports and runs end to end in its CPU dry-run mode (tiny shapes, interpret kernels).

The real run needs a GPU; this proves the script's checks, timings and JSON output work and that every check
passes in interpret mode.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from support.paths import REPO

SCRIPT = REPO / "benchmarks" / "gpu_kernels.py"


def load_script(path: Path, name: str):
    """A benchmark script imported by path, as `python benchmarks/<script>.py` runs it (whether or not the repo
    root is on sys.path)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_kernels = load_script(SCRIPT, "gpu_kernels_script")


def test_dry_run_writes_json(tmp_path):
    out = tmp_path / "gpu_kernels.json"
    status = gpu_kernels.main(["--dry-run", "--seed", "7", "--out", str(out)])
    report = json.loads(out.read_text())
    assert status == 0, report["checks_failed"]
    assert report["dry_run"] and report["implementation"] == "interpret" and report["seed"] == 7
    names = {c["name"] for c in report["checks"]}
    for prefix in ("gating", "encode", "decode", "permute", "gmm", "tgmm", "gmm_vjp", "quant_matmul_fp8_block",
                   "quant_matmul_mxfp4", "quant_matmul_nvfp4", "quant_gmm"):
        assert any(n.startswith(prefix) for n in names), prefix
    assert all(c["ok"] for c in report["checks"])
    assert report["ceilings"]["copy_gbps"] > 0 and report["ceilings"]["matmul_bf16_tflops"] > 0
    timed = {t["name"].split("_")[0] for t in report["timings"]}
    assert {"gmm", "tgmm", "quant", "encode", "decode", "permute", "gating"} <= timed
    for entry in report["timings"]:
        if "target" in entry:
            assert entry["kernel"]["median_s"] > 0 and "met" in entry["target"]


def test_refuses_to_run_without_gpu_unless_dry_run():
    assert gpu_kernels.main(["--skip-timings"]) == 2
