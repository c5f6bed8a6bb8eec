"""The compile gate: every kernel compiles with triton for sm_80 (A100), sm_90 (H100/H200) and gfx942 (MI300).

`pallas_kernels.offline` lowers each case under the target (its tilings and code paths), takes the Triton modules
out of the exported program and compiles them with the pinned pip triton in its own environment
(`TUTEL_JAX_TRITON_PYTHON`, set by .ci/run). Cases: the MoE layer's kernels at the widths of DeepSeek-V3,
GPT-OSS-20B, Mixtral-8x7B and Qwen3-30B-A3B for decode and prefill (forward and backward kernels, every
quantized format), and every tiling the selection tables hold. Asserted: each kernel compiles, its shared memory
fits the target's per-block limit, and a kernel that spills registers says so in the report (written to
`.offline_cache/report_<target>.md`). Compile results are cached by kernel hash in `.offline_cache/` (or
`$TUTEL_JAX_OFFLINE_CACHE`), so reruns only compile what changed.

sm_100 (B200) is not in this gate: its tilings are sm_90's, and XLA's own Triton compiles its kernels in the
deviceless B200 compiles (tests/kernels/test_mosaic_gpu_gmm.py, tests/compile/test_compile_cli.py) at no extra CI time.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from pallas_kernels.offline import (FAMILIES, TRITON_PYTHON_ENV, TRITON_VERSION, compile_kernels, compile_report,
                                    find_triton_python, kernels_of, report_markdown)
from support.paths import REPO


PYTHON = find_triton_python()
CACHE = Path(os.environ.get("TUTEL_JAX_OFFLINE_CACHE") or REPO / ".offline_cache")

needs_triton = pytest.mark.skipif(
    PYTHON is None, reason=f"no triton to compile with: set {TRITON_PYTHON_ENV} to the Python of an environment "
                           f"with triton=={TRITON_VERSION} (.ci/run does)")


def _report(target: str):
    reports = compile_report([target], python=PYTHON, cache_dir=CACHE)
    CACHE.mkdir(parents=True, exist_ok=True)
    (CACHE / f"report_{target}.md").write_text(report_markdown(reports))
    return reports


OFFLINE_TARGETS = ("gfx942", "sm_80", "sm_90")


@needs_triton
@pytest.mark.parametrize("target", OFFLINE_TARGETS)
def test_every_kernel_compiles_and_fits(target):
    """One test per target (the lowering of ~110 cases is shared by its assertions)."""
    reports = _report(target)
    failing = [r.result.summary() for r in reports if not r.result.fits]
    assert not failing, "\n".join(failing)
    groups = {case.split("/")[0] for r in reports for case in r.cases}
    assert {f.name for f in FAMILIES} | {"tiling"} <= groups
    kernels = {r.result.kernel for r in reports}
    assert {"tutel_gating", "tutel_locate", "tutel_encode", "tutel_decode", "tutel_row_dots", "tutel_gmm",
            "tutel_tgmm"} | {f"tutel_quant_gmm_{fmt}" for fmt in pk.quant.FORMATS} <= kernels
    table = report_markdown(reports)
    for r in reports:
        res = r.result
        assert res.shared_limit == pk.TARGETS[target].shared_bytes
        if res.spills:  # the summary and the table both say so
            assert "SPILLS" in res.summary()
            assert (f"stack {res.stack}" if res.stack else f"{res.spill_vgprs} VGPRs") in table


def _fp8_matmul_kernels(target: str, config=None):
    w = jax.eval_shape(pk.quantize_fp8_block, jax.ShapeDtypeStruct((256, 512), jnp.float32))
    x = jax.ShapeDtypeStruct((8, 512), jnp.bfloat16)
    with pk.lowering_context(target) as t:
        return kernels_of(lambda x, w: pk.quant_matmul(x, w, implementation="pallas", config=config), (x, w),
                          t.platform)


@needs_triton
def test_gate_catches_a_hardware_e4m3_conversion_on_sm80(tmp_path):
    """A kernel traced with the sm_90 code path (hardware e4m3 conversion) fails for sm_80: the gate would see
    a regression of the A100 bit-decoding path."""
    (result,) = compile_kernels([(k, "sm_80") for k in _fp8_matmul_kernels("sm_90")], python=PYTHON,
                                cache_dir=tmp_path)
    assert not result.ok and "compute capability >= 89" in result.error
    (result,) = compile_kernels([(k, "sm_80") for k in _fp8_matmul_kernels("sm_80")], python=PYTHON,
                                cache_dir=tmp_path)
    assert result.fits, result.summary()


@needs_triton
def test_gate_catches_shared_memory_over_the_lds(tmp_path):
    """The same tiling with four pipeline stages of 128 x 128 x 128 tiles needs more than MI300's 64 KiB."""
    big = pk.GmmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=4)
    (result,) = compile_kernels([(k, "gfx942") for k in _fp8_matmul_kernels("gfx942", big)], python=PYTHON,
                                cache_dir=tmp_path)
    assert result.ok and result.shared > result.shared_limit and not result.fits
    assert "does not fit" in result.summary()


# ---------------------------------------------------------------- the driver itself (no triton needed)

_FAKE_WORKER = r'''
import json, os, sys
jobs_path, out_path = sys.argv[2], sys.argv[3]  # argv[1] is the real worker's path
with open(out_path, "a") as out:
    for job in json.load(open(jobs_path)):
        out.write(json.dumps({"id": job["id"], "event": "start"}) + "\n"); out.flush()
        if "crash" in open(job["ttir_path"]).read():
            sys.stderr.write("LLVM ERROR: the compiler aborted\n"); sys.stderr.flush()
            os.abort()
        spills = "spill" in open(job["ttir_path"]).read()
        out.write(json.dumps({"id": job["id"], "ok": True, "shared": 70000, "registers": 255,
                              "stack": 24 if spills else 0, "spill_vgprs": 0, "spill_sgprs": 0, "scratch": 0}) + "\n")
'''


def _fake_python(tmp_path):
    """A stand-in for the triton environment's Python that runs `_FAKE_WORKER` instead of the worker."""
    stub = tmp_path / "fake_worker.py"
    stub.write_text(_FAKE_WORKER)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nif [ \"$1\" = -c ]; then echo fake; exit 0; fi\nexec {sys.executable} {stub} \"$@\"\n")
    python.chmod(0o755)
    return str(python)


def _kernel(name, text):
    from pallas_kernels.offline import TritonKernel
    return TritonKernel(name=name, ttir=text, num_warps=4, num_stages=2, grid=(1, 1, 1))


def test_driver_resumes_after_a_compiler_abort_and_reports_spills(tmp_path):
    """A kernel that kills the compiler process is recorded with the compiler's message and the remaining
    kernels still compile; duplicates compile once; a spilling kernel and a too-large one say so."""
    kernels = [_kernel("a", "ok"), _kernel("b", "crash"), _kernel("c", "spill"), _kernel("a", "ok")]
    results = compile_kernels([(k, "sm_80") for k in kernels] + [(kernels[0], "gfx942")],
                              python=_fake_python(tmp_path), cache_dir=tmp_path / "cache", workers=1)
    assert [(r.kernel, r.target) for r in results] == [("a", "sm_80"), ("b", "sm_80"), ("c", "sm_80"),
                                                        ("a", "gfx942")]
    a80, b, c, a942 = results
    assert a80.fits and not a80.spills
    assert not b.ok and "LLVM ERROR: the compiler aborted" in b.error and "does not compile" in b.summary()
    assert c.spills and "SPILLS (stack 24 B)" in c.summary()
    assert a942.ok and not a942.fits and "does not fit" in a942.summary()  # 70,000 B > 64 KiB of LDS
    from pallas_kernels.offline import KernelReport
    table = report_markdown([KernelReport(r, ("case",)) for r in results])
    assert "| stack 24 |" in table and "compile error" in table and "shared memory too large" in table
