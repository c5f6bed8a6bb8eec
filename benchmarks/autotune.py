"""Adaptive-runtime benchmark: `MoETrainer.autotune` picks a configuration; is it really the fastest?

    python benchmarks/autotune.py [--quick] [--capacity-factor 0] [--out benchmarks/results/autotune_cpu.json]

Model: x @ proj -> one MoE layer (top-2 gate, relu ffn experts, E = 8) -> mean squared error to tanh(x)
(+ 0.01 l_aux), adam, over 8 devices; every step is on a fresh random batch. The loss reports the load ratio
(`tutel_jax.runtime._autotune.load_ratio`), so with a capacity that follows the routing (capacity factor <= 0, dropless
by default) the tuner arms its capacity band.

1. `autotune` with the real clock over the candidates (EP 8 flat, overlap d = 2, 2DH (2x4), adaptive r = 0,
   EP 4 x data 2 and, for cf = 0, the dropless implementations with r = 0): compile time is reported apart,
   step times are medians of live training steps.
2. Side by side: the tuned configuration, the default (the first candidate) and the slowest candidate of the
   tuning, each in its own fork of the tuned trainer (`MoETrainer.fork`: the same state, the compiled steps of
   the tuning), timed with `common.time_interleaved` on step thunks (rounds A, B, C, A, B, C, ...), so that the
   tuner's pick is checked by an independent measurement.

Results: a JSON file and a Markdown file next to it (same stem, `.md`: the side-by-side table and the decision
log); the Markdown is also printed.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `tutel_jax` and `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import os  # noqa: E402

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from benchmarks.common import (LayerShape, fmt_ms, fmt_ratio, machine_info, markdown_table,  # noqa: E402
                               quick_parser, repo_root, results_path, run_and_report, time_interleaved)
from tutel_jax import init_params  # noqa: E402
from tutel_jax.runtime import LOAD_RATIO_KEY, Candidate, load_ratio  # noqa: E402
from tutel_jax.runtime import RuntimeConfig, batch_shardings  # noqa: E402
from tutel_jax.training import MoETrainer  # noqa: E402

DEFAULT_OUT = repo_root() / "benchmarks" / "results" / "autotune_cpu.json"


@dataclasses.dataclass(frozen=True)
class Settings:
    layer: LayerShape = LayerShape(model_dim=128, hidden=512, experts=8, batch_per_device=4, tokens=64)
    capacity_factor: float = 0.0
    warmup: int = 2
    measure: int = 7
    runs: int = 15  # side-by-side timed steps per configuration
    quick: bool = False


# quick: bounded dropless (cf < 0: a static buffer, so a fast compile, and a capacity that follows the routing)
QUICK = Settings(layer=LayerShape(model_dim=32, hidden=64, experts=8, batch_per_device=2, tokens=16),
                 capacity_factor=-1.0, warmup=1, measure=2, runs=3, quick=True)


def candidates(settings: Settings) -> list[Candidate]:
    """The configurations tried, the default (EP 8 flat) first; --quick keeps three of them."""
    dropless = settings.capacity_factor == 0
    items = [
        Candidate(RuntimeConfig.ep(8), "EP 8 flat"),
        Candidate(RuntimeConfig.ep(8, a2a_ffn_overlap_degree=2), "EP 8, overlap d=2"),
        Candidate(RuntimeConfig.ep_2dh(2, 4), "2DH (2x4)"),
        Candidate(RuntimeConfig.ep(8, adaptive_r=0), "EP 8, r=0" + (" (dropless ragged)" if dropless else "")),
        Candidate(RuntimeConfig.ep(4, data=2), "EP 4 x data 2"),
    ]
    if dropless:  # the dropless implementation matters where the experts run locally (r = 0); 'loop' is a
        # decode path (a few rows per expert), so training compares ragged and bucketed
        items.append(Candidate(RuntimeConfig.ep(8, adaptive_r=0, dropless_impl="bucketed"),
                               "EP 8, r=0 (dropless bucketed)"))
    if settings.quick:
        items = [items[0], items[1], items[4]]
    return items


def _problem(settings: Settings):
    config = settings.layer.config(settings.capacity_factor)
    m = settings.layer.model_dim
    params = {"proj": jax.random.normal(jax.random.key(3), (m, m)) / np.sqrt(m),
              "moe": init_params(config, jax.random.key(0))}

    def loss_fn(params, batch, moe):
        y, aux = moe(params["moe"], batch["x"] @ params["proj"])
        loss = jnp.mean((y - batch["t"]) ** 2) + 0.01 * aux.l_aux
        return loss, {LOAD_RATIO_KEY: load_ratio(aux), "dropped": aux.dropped_fraction}

    shape = settings.layer.batch_shape(jax.device_count())

    def batch(i: int) -> dict[str, np.ndarray]:
        x = np.random.default_rng(1000 + i).standard_normal(shape, dtype=np.float32)
        return {"x": x, "t": np.tanh(x)}

    return config, params, loss_fn, batch


def run(settings: Settings) -> dict[str, Any]:
    config, params, loss_fn, batch = _problem(settings)
    cands = candidates(settings)
    trainer = MoETrainer(config, loss_fn, optax.adam(1e-3), params, cands[0].runtime, deterministic=True)
    counter = itertools.count()
    report = trainer.autotune(cands, batches=lambda: batch(next(counter)), warmup=settings.warmup,
                              measure=settings.measure)

    by_median = sorted(report.measurements, key=lambda m: m.median_s)
    worst = by_median[-1].candidate
    tuned = next(m.candidate for m in report.measurements if m.candidate.label == report.label)
    roles: dict[str, list[str]] = {}  # label -> roles; one timed variant per distinct configuration
    for role, cand in (("tuned", tuned), ("default", cands[0]), ("worst", worst)):
        roles.setdefault(cand.label, []).append(role)
    runtime_of = {c.label: c.runtime for c in cands}
    fixed = [batch(10_000 + i) for i in range(4)]
    thunks, forks = {}, []
    for label in roles:
        t = trainer.fork()  # the tuned state, the compiled steps of the tuning: nothing compiles again
        t.switch(runtime_of[label])
        # placed once on this trainer's layout, so that a timed step moves no batch
        cycle = itertools.cycle([jax.device_put(b, batch_shardings(b, t.layout)) for b in fixed])
        thunks[label] = (lambda t, cycle: (lambda: t.step(next(cycle))))(t, cycle)
        forks.append(t)
    compiled = trainer.cache_info().compiles
    timings = time_interleaved(thunks, settings.runs, warmup=1)
    tuned_s = timings[tuned.label].median_s
    rows = [{"label": label, "roles": roles[label], "config": runtime_of[label].describe(),
             "median_s": timings[label].median_s, "ratio_to_tuned": timings[label].median_s / tuned_s,
             "timing": timings[label].as_dict()} for label in roles]
    return {"machine": machine_info(), "settings": dataclasses.asdict(settings),
            "candidates": [{"label": c.label, "config": c.runtime.describe()} for c in cands],
            "autotune": report.as_dict(), "decision_log": trainer.autotune_log.as_dicts(), "side_by_side": rows,
            "side_by_side_compiles": sum(t.cache_info().compiles - compiled for t in forks)}


def _opt(value: float | None, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def to_markdown(result: dict[str, Any]) -> str:
    m, s, a = result["machine"], result["settings"], result["autotune"]
    head = (
        f"Measured on {m['backend']} ({m['device_count']} devices, {m['cpu_affinity']} CPUs), jax {m['jax_version']}, "
        f"{m['date']}. One MoE layer ({LayerShape(**s['layer']).describe()}; cf {s['capacity_factor']:g}, float32) "
        f"+ adam, a fresh batch every step. Autotune: {len(result['candidates'])} candidates, {s['warmup']} warmup + "
        f"{s['measure']} timed training steps each (compile time reported apart); it chose **{a['label']}** "
        f"({a['speedup']:.2f}x faster than the default in its own measurement). Side by side: forks of the tuned "
        f"trainer (same state), timed in interleaved rounds (`common.time_interleaved`, median of {s['runs']} steps)."
        "\n\n")
    rows = [[r["label"], ", ".join(r["roles"]), fmt_ms(r["median_s"]), fmt_ratio(r["ratio_to_tuned"]),
             r["timing"]["runs"]] for r in result["side_by_side"]]
    table = markdown_table(["config", "role", "ms / step", "vs tuned", "runs"], rows, align="llrrr")
    log_rows = [[e["event"], e["label"], fmt_ms(e["median_s"]) if e["median_s"] is not None else "", e["runs"] or "",
                 _opt(e["compile_s"], ".2f"), _opt(e["load_ratio"], ".3g"), e["reason"]]
                for e in result["decision_log"]]
    log = markdown_table(["event", "config", "ms / step", "runs", "compile s", "load ratio", "reason"], log_rows,
                         align="llrrrrl")
    return head + table + "\nDecision log:\n\n" + log


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = quick_parser(__doc__, "small sizes, three candidates (smoke test)", DEFAULT_OUT, devices=8)
    parser.add_argument("--capacity-factor", type=float, default=None,
                        help="the gate's capacity factor (default 0: dropless; > 0 fixed, < 0 bounded dropless)")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else Settings()
    if args.capacity_factor is not None:
        settings = dataclasses.replace(settings, capacity_factor=args.capacity_factor)
    return run_and_report(run, to_markdown, settings, results_path(args, DEFAULT_OUT))


if __name__ == "__main__":
    main()
