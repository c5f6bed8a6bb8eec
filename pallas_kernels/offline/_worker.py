"""Compiles Triton modules (text) for GPU targets with the pip `triton` package; no JAX, no GPU.

Run by `pallas_kernels.offline._compile` with the Python of an environment that has triton installed:

    python _worker.py JOBS.json RESULTS.jsonl

JOBS.json is a list of {"id", "ttir_path", "backend" ("cuda" | "hip"), "arch" (80, 90 or "gfx942"),
"warp_size", "num_warps", "num_stages"}. For each job it appends {"id", "event": "start"} to RESULTS.jsonl, then
the result: {"id", "ok": true, "shared", "registers", "stack", "spill_vgprs", "spill_sgprs", "scratch"} or
{"id", "ok": false, "error"}. An LLVM fatal error aborts the process: the caller sees a start without a result,
takes the error from stderr and resumes with the remaining jobs.

Resources: `shared` is the kernel's static shared memory (LDS) in bytes (Triton checks it against the device
only at load time). CUDA: registers and stack bytes from `cuobjdump -res-usage` (a stack frame means spills).
ROCm: VGPRs, VGPR/SGPR spill counts and scratch bytes from the AMDGCN assembly.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager


def _cuda_resources(cubin: bytes) -> dict:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    match = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", text)
    if match is None:
        raise RuntimeError(f"cannot read cuobjdump -res-usage output: {text[:400]!r}")
    regs, stack, _, local = (int(v) for v in match.groups())
    return {"registers": regs, "stack": stack + local, "spill_vgprs": 0, "spill_sgprs": 0, "scratch": 0}


def _amd_resources(amdgcn: str) -> dict:
    def field(pattern: str) -> int:
        match = re.search(pattern, amdgcn)
        return int(match.group(1)) if match else 0

    return {"registers": field(r"\.vgpr_count:\s+(\d+)"), "stack": 0,
            "spill_vgprs": field(r"\.vgpr_spill_count:\s+(\d+)"),
            "spill_sgprs": field(r"\.sgpr_spill_count:\s+(\d+)"), "scratch": field(r"; ScratchSize:\s+(\d+)")}


def compile_job(job: dict) -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import compile as triton_compile

    target = GPUTarget(job["backend"], job["arch"], job["warp_size"])
    kernel = triton_compile(job["ttir_path"], target=target,
                            options=dict(num_warps=job["num_warps"], num_stages=job["num_stages"], num_ctas=1))
    resources = (_cuda_resources(kernel.asm["cubin"]) if job["backend"] == "cuda"
                 else _amd_resources(kernel.asm["amdgcn"]))
    return {"ok": True, "shared": int(kernel.metadata.shared), **resources}


@contextmanager
def _stderr_to(file):
    """Sends file descriptor 2 (where MLIR prints its diagnostics) to `file` inside the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(file.fileno(), 2)
    try:
        yield file
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        file.close()


def main(jobs_path: str, results_path: str) -> None:
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated to silence its warning
    with open(jobs_path) as f:
        jobs = json.load(f)
    with open(results_path, "a") as out:
        for job in jobs:
            out.write(json.dumps({"id": job["id"], "event": "start"}) + "\n")
            out.flush()
            start = time.perf_counter()
            with _stderr_to(tempfile.TemporaryFile(mode="w+")) as diagnostics:
                try:
                    result = compile_job(job)
                except Exception as error:  # a compile error of this kernel: report it, go on with the next
                    diagnostics.seek(0)
                    lines = [l for l in diagnostics.read().splitlines() if "error" in l.lower()]
                    result = {"ok": False, "error": "; ".join([f"{type(error).__name__}: {error}"] + lines[:3])[:2000]}
            result["seconds"] = round(time.perf_counter() - start, 3)
            out.write(json.dumps({"id": job["id"], **result}) + "\n")
            out.flush()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: _worker.py JOBS.json RESULTS.jsonl")
    main(sys.argv[1], sys.argv[2])
