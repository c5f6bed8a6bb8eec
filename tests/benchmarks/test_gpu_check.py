"""benchmarks/gpu_check.py: its CPU dry run (tiny shapes, interpret-mode kernels) passes every check, records the
ragged_all_to_all ones as skipped with their reason and writes the JSON and Markdown reports; its comparison,
summary and exit-status functions turn a mismatch or an exception into a failure and a non-zero exit.

The real run needs a GPU; this proves the script and its verdicts work, not any GPU result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from test_pallas_benchmark import load_script
from support.paths import REPO

SCRIPT = REPO / "benchmarks" / "gpu_check.py"
RAGGED_REASON = "XLA:CPU cannot compile ragged_all_to_all"
CHECKS = ["layer.capacity", "layer.dropless", "generate.deepseek_v3_fp8", "generate.gpt_oss_mxfp4",
          "generate.qwen3_moe_nvfp4", "ep.capacity", "ep.dropless", "ep.dropless_emulated_exchange",
          "timings.gmm_and_quant_decode"]
SKIPPED_ON_CPU = ["ep.dropless_ragged_exchange", "ep.ragged_all_to_all"]
KERNEL_PREFIXES = ("gating", "encode", "decode", "permute", "gmm", "tgmm", "gmm_vjp", "quant_matmul_fp8_block",
                   "quant_matmul_mxfp4", "quant_matmul_nvfp4", "quant_matmul_int8", "quant_matmul_fp8_channel",
                   "quant_gmm")


gpu_check = load_script(SCRIPT, "gpu_check_script")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    return proc, out


def test_dry_run_passes_and_writes_reports(dry_run):
    proc, out = dry_run
    assert out.is_file() and out.with_suffix(".md").is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert proc.returncode == 0, (report["seed"], report["summary"], proc.stdout[-3000:])
    assert report["dry_run"] and report["kernel_backend"] == "interpret" and isinstance(report["seed"], int)
    assert report["machine"]["backend"] == "cpu"
    checks = {c["name"]: c for c in report["checks"]}
    assert len(checks) == len(report["checks"]), "duplicate check names"
    for name in CHECKS:
        assert checks[name]["status"] == "pass", checks.get(name)
    for name in SKIPPED_ON_CPU:
        assert checks[name]["status"] == "skipped" and checks[name]["reason"] == RAGGED_REASON, checks[name]
        assert checks[name]["lowered"] is True
    kernels = [n[len("kernel."):] for n in checks if n.startswith("kernel.")]
    for prefix in KERNEL_PREFIXES:
        assert any(n.startswith(prefix) for n in kernels), prefix
    assert {c["status"] for c in report["checks"]} == {"pass", "skipped"}
    assert report["summary"]["failed"] == [] and set(report["summary"]["skipped"]) == set(SKIPPED_ON_CPU)


def test_dry_run_errors_within_tolerance(dry_run):
    report = json.loads(dry_run[1].read_text())
    compared = [c for c in report["checks"] if "max_relative_error" in c]
    assert len(compared) >= len(KERNEL_PREFIXES) + 6
    for c in compared:
        assert c["max_relative_error"] <= c["tolerance"], c
    for name in ("layer.capacity", "layer.dropless", "ep.capacity", "ep.dropless"):
        parts = next(c for c in report["checks"] if c["name"] == name)["parts"]
        assert set(parts) == {"y", "loss", "grad_params", "grad_x"}, name
    for c in report["checks"]:
        if c["name"].startswith("generate."):
            assert c["tokens_equal"] and c["tokens_xla"] == c["tokens_kernels"], c
            assert np.asarray(c["tokens_xla"]).shape == (2, 8)
        if c["name"].startswith(("generate.", "layer.")):  # the interpreted kernels really ran
            assert c["pallas_calls"] > 0 and c["kernel_backend"] == "interpret", c


def test_dry_run_timings_and_markdown(dry_run):
    report = json.loads(dry_run[1].read_text())
    assert report["ceilings"]["copy_gbps"] > 0 and report["ceilings"]["matmul_bf16_tflops"] > 0
    timed = {t["name"].split("_")[0] for t in report["timings"]}
    assert {"gmm", "tgmm", "quant", "dense"} <= timed
    assert all(t["kernel"]["median_s"] > 0 for t in report["timings"] if "target" in t)
    md = dry_run[1].with_suffix(".md").read_text()
    assert "dry run" in md and md.count("| layer.") == 2 and RAGGED_REASON in md
    assert "| timing |" in md


# ---------------------------------------------------------------------------------- verdicts, without a run


def test_compare_reports_a_mismatch():
    expected = {"y": jnp.ones((4, 3)), "ids": jnp.arange(4)}
    assert gpu_check.compare(expected, expected, 1e-5)["status"] == "pass"
    wrong = {"y": jnp.ones((4, 3)).at[2, 1].add(1e-3), "ids": jnp.arange(4)}
    record = gpu_check.compare(wrong, expected, 1e-5)
    assert record["status"] == "fail" and record["max_relative_error"] == pytest.approx(1e-3, rel=1e-3)
    assert gpu_check.compare(wrong, expected, 1e-2)["status"] == "pass"
    ids_off = {"y": jnp.ones((4, 3)), "ids": jnp.arange(4).at[0].set(1)}  # integers: exact
    assert gpu_check.compare(ids_off, expected, 1.0)["status"] == "fail"
    assert gpu_check.compare({"y": jnp.ones((4, 2)), "ids": jnp.arange(4)}, expected, 1.0)["status"] == "fail"
    nan = {"y": jnp.ones((4, 3)).at[0, 0].set(jnp.nan), "ids": jnp.arange(4)}
    assert gpu_check.compare(nan, expected, 1.0)["status"] == "fail"


def test_merge_fails_when_one_part_fails():
    ok = gpu_check.compare(jnp.ones(3), jnp.ones(3), 1e-5)
    bad = gpu_check.compare(jnp.full(3, 2.0), jnp.ones(3), 1e-5)
    record = gpu_check.merge({"y": ok, "grad_x": bad})
    assert record["status"] == "fail" and "grad_x" in record["detail"] and record["max_relative_error"] == 1.0
    assert gpu_check.merge({"y": ok, "loss": ok})["status"] == "pass"


def test_exception_is_a_recorded_failure_and_exit_status():
    def broken():
        raise RuntimeError("kernel exploded")

    failed = gpu_check.run_check("layer.broken", broken)
    assert failed["status"] == "fail" and "RuntimeError: kernel exploded" in failed["error"]
    passed = gpu_check.run_check("layer.fine", lambda: {"status": "pass"})
    skipped = gpu_check.run_check("ep.skip", lambda: gpu_check.skipped("no backend"))
    assert gpu_check.exit_status([passed, skipped]) == 0
    assert gpu_check.exit_status([passed, skipped, failed]) == 1
    assert gpu_check.exit_status([passed, {"name": "x", "status": "???"}]) == 1
    summary = gpu_check.summarize([passed, skipped, failed])
    assert summary["counts"] == {"pass": 1, "fail": 1, "skipped": 1}
    assert summary["failed"] == ["layer.broken"] and summary["skipped"] == {"ep.skip": "no backend"}


def test_kernel_path_without_kernels_fails():
    record = gpu_check.require_kernels({"status": "pass", "detail": "tokens equal"}, 0)
    assert record["status"] == "fail" and "no pallas_call" in record["error"]
    assert gpu_check.require_kernels({"status": "pass"}, 3)["status"] == "pass"
    import jax
    from tutel_jax import make_config, moe_apply
    kwargs, cf = gpu_check.layer_kwargs("capacity", gpu_check.layer_sizes(True))
    params = gpu_check.layer_params(make_config(**kwargs), jax.random.key(0))
    x = jnp.ones((2, 4, kwargs["model_dim"]))
    calls = lambda backend: gpu_check.pallas_calls(
        lambda p, x: moe_apply(p, x, make_config(**kwargs, kernel_backend=backend), capacity_factor=cf)[0],
        params, x)
    assert calls(None) == 0 and calls("interpret") > 0


def test_kernel_check_entries_keep_their_verdict():
    bad = gpu_check.from_kernel_check({"name": "gmm_bfloat16", "ok": False, "max_abs_error": 1.0,
                                       "max_relative_error": 0.5, "tolerance": 2e-2, "seconds": 0.1})
    assert bad["name"] == "kernel.gmm_bfloat16" and bad["status"] == "fail"
    assert gpu_check.exit_status([bad]) == 1
    crashed = gpu_check.from_kernel_check({"name": "gating", "ok": False, "error": "Boom", "seconds": 0.0})
    assert crashed["status"] == "fail" and crashed["error"] == "Boom"


def test_markdown_shows_failures(tmp_path):
    checks = [gpu_check.run_check("layer.bad", lambda: gpu_check.compare(jnp.full(2, 3.0), jnp.ones(2), 1e-5)),
              gpu_check.run_check("ep.ragged_all_to_all", lambda: gpu_check.skipped(RAGGED_REASON))]
    report = {"dry_run": True, "seed": 1, "kernel_backend": "interpret", "kernel_implementation": "interpret",
              "machine": {"device_kind": "cpu", "backend": "cpu", "device_count": 1, "jax_version": "x",
                          "date": "today"},
              "note": "test", "checks": checks, "summary": gpu_check.summarize(checks), "ceilings": None,
              "timings": [], "seconds": 0.0}
    json_path, md_path = gpu_check.write_report(report, tmp_path / "r.json")
    md = md_path.read_text()
    assert "| layer.bad | fail |" in md and f"skipped: {RAGGED_REASON}" in md and "1 failed" in md
    assert json.loads(json_path.read_text())["summary"]["failed"] == ["layer.bad"]


def test_ragged_all_to_all_expectation():
    cases = gpu_check.ragged_all_to_all_cases(5)
    assert sorted(int(c[3][0]) for c in cases)[0] == 0  # an empty slice among them
    operand, output, start, size, dest, _ = cases[0]
    got = gpu_check.ragged_all_to_all_expected(*cases[0])
    s, n, d = int(start[0]), int(size[0]), int(dest[0])
    np.testing.assert_array_equal(got[d:d + n], operand[s:s + n])
    np.testing.assert_array_equal(np.delete(got, range(d, d + n), 0), np.delete(output, range(d, d + n), 0))


def test_refuses_to_run_without_gpu_unless_dry_run():
    assert gpu_check.main([]) == 2


def test_arguments_and_fresh_seeds():
    args = gpu_check.parse_args(["--dry-run", "--seed", "5", "--out", "x/r.json", "--quick"])
    assert args.dry_run and args.quick and args.seed == 5 and args.out == Path("x/r.json")
    assert gpu_check.parse_args([]).seed is None  # a fresh seed is drawn (and recorded) at run time
    seeds = {gpu_check.gk.fresh_seed() for _ in range(8)}
    assert len(seeds) > 1 and all(0 <= s < 2 ** 31 for s in seeds)


def test_default_output_of_a_dry_run_is_not_the_results_folder():
    assert "benchmarks" not in gpu_check.default_output(True).parts
    assert gpu_check.default_output(False) == REPO / "benchmarks" / "results" / "gpu_check.json"
