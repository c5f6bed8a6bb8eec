"""Compiling the extracted Triton kernels for each target with the pip `triton` package, in parallel.

Triton lives in its own environment (its LLVM must not meet jaxlib's), so the compile runs in subprocesses of
that environment's Python (`_worker.py`), found from `TUTEL_JAX_TRITON_PYTHON`. Equal kernels (same module text
and launch parameters) compile once per target, and results are cached on disk by that hash, the triton version and
the compile worker's own source, so a rerun only compiles what changed.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Iterable

from ..targets import Target, get_target
from ._extract import TritonKernel

__all__ = ["CompileResult", "TRITON_PYTHON_ENV", "TRITON_VERSION", "find_triton_python", "triton_version",
           "compile_kernels"]

TRITON_PYTHON_ENV = "TUTEL_JAX_TRITON_PYTHON"
#: the triton release the offline compile is pinned to (close to the fork XLA builds with)
TRITON_VERSION = "3.9.0"
_WORKER = Path(__file__).with_name("_worker.py")


@dataclasses.dataclass(frozen=True)
class CompileResult:
    """The outcome of compiling one kernel for one target.

    Attributes:
      kernel: the kernel's name; digest: its hash (see TritonKernel.digest).
      target: the target's name.
      ok: it compiled; error: the compiler's message otherwise.
      shared: static shared memory / LDS bytes; shared_limit: the target's per-block limit.
      registers: registers (CUDA) or VGPRs (ROCm) per thread.
      stack: CUDA stack + local bytes per thread (non-zero: the kernel spills).
      spill_vgprs, spill_sgprs, scratch: ROCm spill counts and scratch bytes.
    """

    kernel: str
    digest: str
    target: str
    ok: bool
    error: str | None = None
    shared: int = 0
    shared_limit: int = 0
    registers: int = 0
    stack: int = 0
    spill_vgprs: int = 0
    spill_sgprs: int = 0
    scratch: int = 0

    @property
    def fits(self) -> bool:
        """It compiled and its shared memory fits the target's per-block limit (it would load)."""
        return self.ok and self.shared <= self.shared_limit

    @property
    def spills(self) -> bool:
        return self.stack > 0 or self.spill_vgprs > 0 or self.spill_sgprs > 0 or self.scratch > 0

    def summary(self) -> str:
        """One line: target, kernel, and what is wrong or its resources."""
        head = f"{self.target} {self.kernel} [{self.digest}]"
        if not self.ok:
            return f"{head}: does not compile: {self.error}"
        text = f"{head}: shared {self.shared}/{self.shared_limit} B, {self.registers} registers"
        if self.spills:
            text += (f", SPILLS (stack {self.stack} B)" if self.stack else
                     f", SPILLS ({self.spill_vgprs} VGPRs, {self.spill_sgprs} SGPRs, scratch {self.scratch} B)")
        if not self.fits:
            text += ": shared memory does not fit"
        return text


def find_triton_python() -> str | None:
    """The Python of the triton environment: `$TUTEL_JAX_TRITON_PYTHON`, if it names an executable."""
    path = os.environ.get(TRITON_PYTHON_ENV, "")
    return path if path and os.access(path, os.X_OK) else None


def triton_version(python: str) -> str | None:
    """The triton version importable by `python`, or None."""
    run = subprocess.run([python, "-c", "import triton; print(triton.__version__)"], capture_output=True, text=True,
                         timeout=120)
    return run.stdout.strip() if run.returncode == 0 else None


def _write_atomic(path: Path, text: str) -> None:
    """Concurrent runs (test workers) may write the same cache entry: write a private file, then rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _job(kernel: TritonKernel, target: Target, ttir_path: Path) -> dict:
    return {"id": f"{kernel.digest}-{target.name}", "ttir_path": str(ttir_path),
            "backend": "cuda" if target.platform == "cuda" else "hip", "arch": target.arch,
            "warp_size": target.warp_size, "num_warps": kernel.num_warps, "num_stages": kernel.num_stages}


def _run_worker(python: str, jobs: list[dict], workdir: Path, env: dict, index: int, timeout: float) -> dict:
    """Runs one worker over `jobs`; a job that kills the compiler is recorded with stderr and the rest resumed."""
    results: dict[str, dict] = {}
    remaining = list(jobs)
    attempt = 0
    while remaining:
        attempt += 1
        jobs_file = workdir / f"jobs_{index}_{attempt}.json"
        out_file = workdir / f"results_{index}_{attempt}.jsonl"
        jobs_file.write_text(json.dumps(remaining))
        run = subprocess.run([python, str(_WORKER), str(jobs_file), str(out_file)], capture_output=True, text=True,
                             env=env, timeout=timeout)
        started = None
        for line in out_file.read_text().splitlines() if out_file.exists() else []:
            record = json.loads(line)
            if record.get("event") == "start":
                started = record["id"]
            else:
                results[record["id"]] = record
                started = None
        if run.returncode != 0:
            if started is None:  # died outside a compile: nothing to blame, report for every job left
                message = (run.stderr or run.stdout).strip()[-2000:] or f"worker exited with {run.returncode}"
                for job in remaining:
                    results.setdefault(job["id"], {"ok": False, "error": message})
            else:  # the compiler aborted (LLVM fatal error) on `started`
                lines = [l for l in run.stderr.splitlines() if l.strip() and "Warning" not in l]
                error = next((l for l in lines if "ERROR" in l or "error" in l), lines[-1] if lines else "")
                results[started] = {"ok": False, "error": error.strip()[-2000:] or f"exit {run.returncode}"}
        remaining = [job for job in remaining if job["id"] not in results]
    return results


def compile_kernels(
    items: Iterable[tuple[TritonKernel, str | Target]],
    *,
    python: str,
    cache_dir: str | os.PathLike,
    workers: int = 2,
    timeout: float = 1800.0,
) -> list[CompileResult]:
    """Compiles every (kernel, target) pair; duplicates compile once.

    Args:
      items: kernels with the target each was lowered for (a kernel lowered for "rocm" goes to gfx942).
      python: the triton environment's Python (`find_triton_python()`).
      cache_dir: where compile results and Triton's own cache are kept (reruns reuse them).
      workers: parallel compiler processes.
      timeout: seconds one worker process may take.

    Returns:
      One CompileResult per distinct (kernel, target), in first-seen order.
    """
    cache = Path(cache_dir)
    (cache / "results").mkdir(parents=True, exist_ok=True)
    (cache / "ttir").mkdir(parents=True, exist_ok=True)
    # a result holds for this kernel, this triton and this worker (which judges spills and shared memory)
    version = f"{triton_version(python) or 'unknown'}-{hashlib.sha256(_WORKER.read_bytes()).hexdigest()[:12]}"
    order: list[tuple[TritonKernel, Target]] = []
    seen = set()
    for kernel, target in items:
        target = get_target(target)
        if (kernel.digest, target.name) not in seen:
            seen.add((kernel.digest, target.name))
            order.append((kernel, target))
    records: dict[str, dict] = {}
    todo: list[dict] = []
    for kernel, target in order:
        job_id = f"{kernel.digest}-{target.name}"
        cached = cache / "results" / f"{job_id}-{version}.json"
        if cached.exists():
            records[job_id] = json.loads(cached.read_text())
            continue
        ttir_path = cache / "ttir" / f"{kernel.digest}.ttir"
        if not ttir_path.exists():
            _write_atomic(ttir_path, kernel.ttir)
        todo.append(_job(kernel, target, ttir_path))
    if todo:
        env = dict(os.environ, TRITON_CACHE_DIR=str(cache / "triton"), TRITON_DEFAULT_FP_FUSION="1")
        chunks = [todo[i::workers] for i in range(max(1, min(workers, len(todo))))]
        with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(len(chunks)) as pool:
            futures = [pool.submit(_run_worker, python, chunk, Path(tmp), env, i, timeout)
                       for i, chunk in enumerate(chunks)]
            for future in futures:
                for job_id, record in future.result().items():
                    records[job_id] = record
                    _write_atomic(cache / "results" / f"{job_id}-{version}.json", json.dumps(record))
    results = []
    for kernel, target in order:
        record = dict(records[f"{kernel.digest}-{target.name}"])
        record.pop("id", None)
        results.append(CompileResult(kernel=kernel.name, digest=kernel.digest, target=target.name,
                                     shared_limit=target.shared_bytes, ok=bool(record.pop("ok")),
                                     error=record.pop("error", None),
                                     **{k: int(v) for k, v in record.items() if k in _RESOURCE_FIELDS}))
    return results


_RESOURCE_FIELDS = ("shared", "registers", "stack", "spill_vgprs", "spill_sgprs", "scratch")

