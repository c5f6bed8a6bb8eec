"""Check records of `benchmarks/gpu_check.py`: one dict per check ({'name', 'status': pass / fail / skipped, its
errors against their tolerance, 'seconds'}), how a check runs (an exception is a failure, never an abort), how
comparisons and kernel counts become records, and the run's summary and exit status."""

from __future__ import annotations

import time
import traceback
from typing import Any, Callable

import jax

from benchmarks import gpu_kernels as gk

PASS, FAIL, SKIPPED = "pass", "fail", "skipped"


def error_text(exc: BaseException) -> str:
    """The exception and the last frames of its traceback, short enough for a JSON report."""
    frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return (f"{type(exc).__name__}: {exc}"[:1500] + "\n" + "".join(frames[-3:])[-1500:]).strip()


def run_check(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Runs one check; `fn` returns its record ({'status': ..., ...}). An exception is a failure with its
    message, never an abort."""
    started = time.perf_counter()
    try:
        record = dict(fn())
    except Exception as exc:  # noqa: BLE001 - any failure of a check is reported, the run goes on
        record = {"status": FAIL, "error": error_text(exc)}
    record = {"name": name, **record, "seconds": round(time.perf_counter() - started, 3)}
    print(f"  {name:<44} {describe(record)}", flush=True)
    return record


def describe(record: dict[str, Any]) -> str:
    """One line: status, then the error against its tolerance, the skip reason or the failure message."""
    status = record["status"]
    if status == SKIPPED:
        return f"skipped: {record.get('reason', '')}"
    if "error" in record:
        return f"{status.upper()}: {record['error'].splitlines()[0][:200]}"
    text = status if status == PASS else status.upper()
    if "max_relative_error" in record:
        text += f" (error {record['max_relative_error']:.2e} <= {record['tolerance']:.0e} x scale)" \
            if status == PASS else f" (error {record['max_relative_error']:.2e} > {record['tolerance']:.0e} x scale)"
    if record.get("detail"):
        text += f" {record['detail']}"
    return text


def skipped(reason: str, **extra: Any) -> dict[str, Any]:
    return {"status": SKIPPED, "reason": reason, **extra}


def compare(actual: Any, expected: Any, tolerance: float, *, relative_to_leaf: bool = True) -> dict[str, Any]:
    """A check record from `gpu_kernels.compare_trees`: per leaf, |actual - expected| <= tolerance x scale,
    scale = max |expected leaf| (relative_to_leaf) or max(1, max |expected leaf|)."""
    result = gk.compare_trees(actual, expected, tolerance, scale_floor=1e-30 if relative_to_leaf else 1.0)
    return {"status": PASS if result["ok"] else FAIL, "max_abs_error": result["max_abs_error"],
            "max_relative_error": result["max_relative_error"], "tolerance": tolerance}


def merge(parts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One record from named comparisons: fails if any part fails; the worst relative error; per-part errors."""
    worst = max(parts.values(), key=lambda p: p["max_relative_error"])
    failed = [name for name, p in parts.items() if p["status"] != PASS]
    record = {"status": FAIL if failed else PASS, "max_abs_error": max(p["max_abs_error"] for p in parts.values()),
              "max_relative_error": worst["max_relative_error"], "tolerance": worst["tolerance"],
              "parts": {name: {k: p[k] for k in ("status", "max_relative_error", "max_abs_error")}
                        for name, p in parts.items()}}
    if failed:
        record["detail"] = "mismatch in " + ", ".join(failed)
    return record


def from_kernel_check(entry: dict[str, Any]) -> dict[str, Any]:
    """A gpu_kernels check entry ({'ok', 'max_abs_error', 'max_relative_error', 'tolerance', ...}) as a record of
    this script (there the scale is max(1, max |reference|))."""
    record = {"name": f"kernel.{entry['name']}", "status": PASS if entry["ok"] else FAIL}
    if "error" in entry:
        record["error"] = entry["error"]
    for key in ("max_abs_error", "max_relative_error", "tolerance", "dtype", "seconds"):
        if key in entry:
            record[key] = entry[key]
    return record


def summarize(checks: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts per status, the failed checks' names and the skipped ones' reasons."""
    return {"total": len(checks), "counts": {s: sum(c["status"] == s for c in checks) for s in (PASS, FAIL, SKIPPED)},
            "failed": [c["name"] for c in checks if c["status"] == FAIL],
            "skipped": {c["name"]: c.get("reason", "") for c in checks if c["status"] == SKIPPED}}


def exit_status(checks: list[dict[str, Any]]) -> int:
    """1 when any check failed (or has an unknown status), else 0; skipped checks do not fail the run."""
    return 0 if all(c["status"] in (PASS, SKIPPED) for c in checks) else 1


def count_primitive(jaxpr: Any, name: str) -> int:
    """Equations of primitive `name` in a (Closed)Jaxpr, nested jaxprs (jit, scan, cond, custom VJP) included."""
    from jax.extend.core import ClosedJaxpr, Jaxpr

    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            count += 1
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, (ClosedJaxpr, Jaxpr)):
                    count += count_primitive(sub, name)
    return count


def pallas_calls(fn: Callable, *args) -> int:
    """How many Pallas kernels the traced fn(*args) runs: 0 means the kernel path fell back to XLA entirely."""
    return count_primitive(jax.make_jaxpr(fn)(*args), "pallas_call")


def require_kernels(record: dict[str, Any], calls: int) -> dict[str, Any]:
    """Records the Pallas kernel count; a kernel path without any kernel compared XLA with XLA: a failure."""
    record = {**record, "pallas_calls": calls}
    record["detail"] = "; ".join(filter(None, (record.get("detail"), f"{calls} pallas_call in the kernel path")))
    if calls == 0:
        record.update(status=FAIL, error="the kernel path traced no pallas_call (every op fell back to XLA)")
    return record
