"""Shared helpers for the benchmarks: interleaved median timing, machine info, JSON and Markdown writers.

Timing protocol (`time_interleaved`):
  1. every variant is called once and blocked on (compile + first run, reported as `first_call_s`, excluded),
     then `warmup` more times, untimed;
  2. the variants then run in rounds (A, B, A, B, ...) so that slow drifts of a noisy machine hit all of them
     alike; each call is timed with `time.perf_counter` around `jax.block_until_ready`; a fast variant makes one
     untimed call at the start of its turn, so it is not timed right after a slow neighbour flushed its caches;
  3. each variant reports the median (and min, max, quartiles) of its timed runs and how many there were.
With a `time_budget_s` per variant, a slow variant gets fewer runs (never fewer than `min_runs`, so every
variant is measured) and a fast one more (up to `max_runs`, several per round).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax

__all__ = ["LayerShape", "Timing", "time_interleaved", "tune_malloc", "machine_info", "write_json", "markdown_table", "write_text",
           "fmt_ms", "fmt_ratio", "repo_root", "write_results", "run_and_report", "quick_parser", "results_path"]


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """One FFN MoE layer of the training benchmarks and its batch: Tutel's top-2 gate over `experts` relu
    experts per device (`count_per_node`), model_dim M, expert hidden H; inputs [batch_per_device * devices,
    tokens, M]."""

    model_dim: int = 256
    hidden: int = 2048
    experts: int = 4
    batch_per_device: int = 2
    tokens: int = 64

    def config(self, capacity_factor: float) -> Any:
        """The layer's `MoEConfig` with this gate capacity factor."""
        from tutel_jax import make_config  # benchmarks that time no MoE layer need not import it

        return make_config({"type": "top", "k": 2, "capacity_factor": capacity_factor}, self.model_dim,
                           {"type": "ffn", "count_per_node": self.experts, "hidden_size_per_expert": self.hidden,
                            "activation_fn": jax.nn.relu})

    def batch_shape(self, devices: int) -> tuple[int, int, int]:
        """[B, T, M] of the global batch over `devices` devices."""
        return (self.batch_per_device * devices, self.tokens, self.model_dim)

    def describe(self) -> str:
        return (f"E = {self.experts}, model_dim {self.model_dim}, hidden {self.hidden}, top-2; batch "
                f"{self.batch_per_device} x {self.tokens} tokens per device")


def repo_root() -> Path:
    """The repository root (the parent of `benchmarks/`)."""
    return Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Timing:
    """Wall-clock statistics of one variant, in seconds."""

    median_s: float
    min_s: float
    max_s: float
    q25_s: float
    q75_s: float
    runs: int
    first_call_s: float

    def as_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of an already sorted, non-empty sequence."""
    pos = q * (len(sorted_values) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _timed_call(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def time_interleaved(
    variants: dict[str, Callable[[], Any]],
    runs: int,
    *,
    time_budget_s: float | None = None,
    min_runs: int = 3,
    max_runs: int | None = None,
    warmup: int = 1,
    rewarm_below_s: float = 0.25,
) -> dict[str, Timing]:
    """Times zero-argument callables in interleaved rounds and returns each one's statistics.

    Args:
      variants: name -> thunk returning JAX arrays (typically a jitted function applied to fixed inputs).
      runs: timed runs per variant when there is no `time_budget_s`.
      time_budget_s: optional wall-clock budget per variant for its timed runs: a variant then gets
        `budget // (its warm call time)` runs, clipped to [min_runs, max_runs].
      min_runs: fewest runs of a variant cut by the budget.
      max_runs: most runs of a fast variant under the budget (default `runs`).
      warmup: untimed calls of each variant after the compiling one (the last one sizes the budget).
      rewarm_below_s: a variant faster than this makes one untimed call before its timed calls of each round,
        so that it is timed after itself (warm caches) rather than right after a much slower neighbour.

    The variants share R = min(runs) rounds; in each round a variant with n runs makes ceil(n / R) of them (at
    most what it has left), so a fast variant with many runs is still spread over the whole period.

    Returns:
      name -> Timing, in the order of `variants`.
    """
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    max_runs = runs if max_runs is None else max_runs
    first_call = {name: _timed_call(fn) for name, fn in variants.items()}
    steady = dict(first_call)
    for _ in range(warmup):
        for name, fn in variants.items():
            steady[name] = _timed_call(fn)
    wanted = {name: runs for name in variants}
    if time_budget_s is not None:
        for name in variants:
            fit = int(time_budget_s // max(steady[name], 1e-9))
            wanted[name] = max(min(min_runs, max_runs), min(max_runs, fit))
    rounds = min(wanted.values())
    per_round = {name: -(-n // rounds) for name, n in wanted.items()}
    samples: dict[str, list[float]] = {name: [] for name in variants}
    while any(len(samples[name]) < wanted[name] for name in variants):
        for name, fn in variants.items():
            todo = min(per_round[name], wanted[name] - len(samples[name]))
            if todo > 0 and steady[name] < rewarm_below_s:
                jax.block_until_ready(fn())
            for _ in range(todo):
                samples[name].append(_timed_call(fn))
    result = {}
    for name in variants:
        values = sorted(samples[name])
        result[name] = Timing(
            median_s=statistics.median(values), min_s=values[0], max_s=values[-1],
            q25_s=_quantile(values, 0.25), q75_s=_quantile(values, 0.75), runs=len(values),
            first_call_s=first_call[name],
        )
    return result


_ALLOCATOR = "system default"


def tune_malloc(mmap_threshold: int = 1 << 30, trim_threshold: int = (1 << 31) - 1) -> str:
    """Makes glibc malloc keep and reuse freed memory instead of returning it to the kernel; returns a summary.

    XLA:CPU takes its temporaries and outputs from malloc. With glibc's defaults a buffer of a few MiB or more
    is often a fresh mmap, and first touching it costs a page fault per 4 KiB page: for a 16 MiB dispatch buffer
    that is ~10-20 ms on a 2-core VM, several times the gather itself, and it comes and goes with the
    allocator's history (bimodal timings). Raising the mmap and trim thresholds removes that noise. Call it
    before the timed work; it is a no-op (returning "system default") where glibc's mallopt is unavailable.
    """
    global _ALLOCATOR
    libc_name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(libc_name) if libc_name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    if mallopt is None or not (mallopt(m_mmap_threshold, mmap_threshold) and mallopt(m_trim_threshold, trim_threshold)):
        return _ALLOCATOR
    _ALLOCATOR = f"glibc mallopt(M_MMAP_THRESHOLD={mmap_threshold}, M_TRIM_THRESHOLD={trim_threshold})"
    return _ALLOCATOR


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: JAX version, backend, devices, CPU count, date."""
    devices = jax.devices()
    return {
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "device_count": len(devices),
        "device_kind": devices[0].device_kind if devices else None,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": sys.version.split()[0],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        # large XLA:CPU temporaries come from malloc; its settings change the cost of page faults a lot
        "allocator": _ALLOCATOR,
        "allocator_env": " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                                  if k.startswith("MALLOC_") or k == "LD_PRELOAD"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_json(path: str | Path, data: Any) -> Path:
    """Writes `data` as indented JSON, creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path


def write_text(path: str | Path, text: str) -> Path:
    """Writes `text`, creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def write_results(out: str | Path | None, result: Any, markdown: str) -> None:
    """Writes `result` as JSON to `out` and `markdown` next to it (.md), and says so; nothing when out is None."""
    if out is None:
        return
    out = Path(out)
    write_json(out, result)
    write_text(out.with_suffix(".md"), markdown)
    print(f"wrote {out} and {out.with_suffix('.md')}")


def run_and_report(run: Callable[[Any], Any], to_markdown: Callable[[Any], str], settings: Any,
                   out: str | Path | None) -> Any:
    """A benchmark's last steps: tuned malloc, `run(settings)`, its Markdown printed, both files written."""
    tune_malloc()
    result = run(settings)
    markdown = to_markdown(result)
    print(markdown)
    write_results(out, result, markdown)
    return result


def quick_parser(doc: str, quick_help: str, default_out: Path, devices: int | None = None
                 ) -> argparse.ArgumentParser:
    """The command line of a benchmark with a `--quick` smoke size: --quick and --out (default `default_out`;
    none with --quick, see `results_path`). With `devices`, `parse_args` refuses to run on fewer devices."""
    parser = _DevicesParser(description=doc.split("\n\n")[0], devices=devices)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", type=Path, default=None, help=f"JSON output (default {default_out}; --quick: none)")
    return parser


class _DevicesParser(argparse.ArgumentParser):
    def __init__(self, *args: Any, devices: int | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.devices = devices

    def parse_args(self, *args: Any, **kwargs: Any) -> argparse.Namespace:
        ns = super().parse_args(*args, **kwargs)
        if self.devices is not None and jax.device_count() < self.devices:
            self.error(f"needs {self.devices} devices, found {jax.device_count()}")
        return ns


def results_path(args: argparse.Namespace, default_out: Path) -> Path | None:
    """Where a `quick_parser` benchmark writes: --out, else nothing for --quick, else `default_out`."""
    return args.out if args.out is not None else (None if args.quick else default_out)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A GitHub Markdown table; `align` is one character per column, 'l' or 'r' (default: all right)."""
    align = align or "r" * len(headers)
    rule = ["---:" if a == "r" else ":---" for a in align]
    lines = ["| " + " | ".join(str(h) for h in headers) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def fmt_ms(seconds: float) -> str:
    """Seconds as milliseconds with ~3 significant digits."""
    ms = seconds * 1e3
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 10:
        return f"{ms:.1f}"
    return f"{ms:.2f}"


def fmt_ratio(value: float) -> str:
    """A ratio with ~3 significant digits and a trailing x."""
    if value >= 100:
        return f"{value:.0f}x"
    if value >= 10:
        return f"{value:.1f}x"
    return f"{value:.2f}x"
