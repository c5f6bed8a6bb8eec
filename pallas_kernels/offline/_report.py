"""The offline compile end to end: export every case for every target, compile, and report.

    python -m pallas_kernels.offline [--targets sm_80,sm_90,gfx942] [--only SUBSTRING] [--workers N]
                                     [--out report.json] [--cache DIR]

needs `TUTEL_JAX_TRITON_PYTHON` (a Python with triton==3.9.0). The report lists, per target, every distinct
kernel with the cases that use it: whether it compiles, its shared memory against the target's limit, its
registers and whether it spills. The exit status is 1 when a kernel fails to compile or does not fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Sequence

from ..targets import TARGETS, lowering_context
from ._cases import Case, all_cases
from ._compile import (
    TRITON_PYTHON_ENV,
    CompileResult,
    compile_kernels,
    find_triton_python,
)
from ._extract import TritonKernel, kernels_of

__all__ = ["KernelReport", "lower_cases", "compile_report", "report_markdown"]


@dataclasses.dataclass(frozen=True)
class KernelReport:
    """A compile result with the cases whose programs contain that kernel."""

    result: CompileResult
    cases: tuple[str, ...]


def lower_cases(target: str, cases: Sequence[Case]) -> list[tuple[Case, list[TritonKernel]]]:
    """Exports each case for `target` (its tilings and code paths) and extracts its Triton kernels.

    Raises:
      AssertionError: a case does not hold the number of kernels it declares (a kernel silently replaced by its
        XLA reference would otherwise go unnoticed).
    """
    lowered = []
    with lowering_context(target) as t:
        for case in cases:
            kernels = kernels_of(case.fn, case.args, t.platform)
            if len(kernels) != case.kernels:
                raise AssertionError(f"{case.name} on {target}: expected {case.kernels} Triton kernels, "
                                     f"found {len(kernels)}")
            lowered.append((case, kernels))
    return lowered


def compile_report(targets: Sequence[str], *, python: str, cache_dir: str | Path, workers: int = 2,
                   only: str | None = None) -> list[KernelReport]:
    """Lowers and compiles every case (optionally only names containing `only`) for each target."""
    items, users = [], {}
    for target in targets:
        cases = [c for c in all_cases(target) if only is None or only in c.name]
        for case, kernels in lower_cases(target, cases):
            for kernel in kernels:
                items.append((kernel, target))
                users.setdefault((kernel.digest, target), []).append(case.name)
    results = compile_kernels(items, python=python, cache_dir=cache_dir, workers=workers)
    return [KernelReport(r, tuple(users[(r.digest, r.target)])) for r in results]


def report_markdown(reports: Sequence[KernelReport]) -> str:
    """A table per target: kernel, first case, shared memory / limit, registers, spills, status."""
    lines = []
    for target in TARGETS:
        rows = [r for r in reports if r.result.target == target]
        if not rows:
            continue
        bad = sum(not r.result.fits for r in rows)
        spills = sum(r.result.spills for r in rows)
        lines += [f"### {target} ({TARGETS[target].gpus}): {len(rows)} kernels, {bad} failing, {spills} spilling",
                  "", "| kernel | used by | shared (B) | registers | spills | status |", "|---|---|---|---|---|---|"]
        for r in rows:
            res = r.result
            status = "ok" if res.fits else ("compile error" if not res.ok else "shared memory too large")
            used = r.cases[0] + (f" (+{len(r.cases) - 1})" if len(r.cases) > 1 else "")
            spill = ("stack " + str(res.stack) if res.stack else f"{res.spill_vgprs} VGPRs") if res.spills else "no"
            lines.append(f"| {res.kernel} | {used} | {res.shared} / {res.shared_limit} | {res.registers} | "
                         f"{spill} | {status} |")
        lines.append("")
    return "\n".join(lines)


def report_json(reports: Sequence[KernelReport]) -> list[dict]:
    return [{**dataclasses.asdict(r.result), "fits": r.result.fits, "spills": r.result.spills,
             "cases": list(r.cases)} for r in reports]


def main(argv: Sequence[str] | None = None) -> int:


    parser = argparse.ArgumentParser(prog="python -m pallas_kernels.offline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--only", default=None, help="only cases whose name contains this")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "tutel_jax", "offline"))
    parser.add_argument("--out", default=None, help="write the JSON report here (and a .md beside it)")
    args = parser.parse_args(argv)
    python = find_triton_python()
    if python is None:
        print(f"error: set {TRITON_PYTHON_ENV} to a Python with triton installed", file=sys.stderr)
        return 2
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        print(f"error: unknown targets {unknown}; expected some of {sorted(TARGETS)}", file=sys.stderr)
        return 2
    reports = compile_report(targets, python=python, cache_dir=args.cache, workers=args.workers, only=args.only)
    text = report_markdown(reports)
    print(text)
    for r in reports:
        if not r.result.fits:
            print(r.result.summary(), file=sys.stderr)
    if args.out:
        out = Path(args.out)
        out.write_text(json.dumps(report_json(reports), indent=1))
        out.with_suffix(".md").write_text(text)
    return 1 if any(not r.result.fits for r in reports) else 0
