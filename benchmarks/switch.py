"""Switch-latency benchmark: what a runtime reconfiguration (`MoETrainer.switch`) costs, per transition.

    python benchmarks/switch.py [--quick] [--cycles 5] [--out benchmarks/results/switch_cpu.json]

Model: one MoE layer (top-2 gate, relu ffn experts, E = 4, model_dim 256, hidden 2048, float32) trained with adam;
the training state (params + adam mu / nu) is about 48 MiB, all but the gate in expert tensors [E, ...]. Batch: 2
samples x 64 tokens per device, 8 devices. The run goes around a cycle of configurations (mesh layouts, adaptive r,
overlap degree, 2DH, a top-k / capacity switch) and back to the first, `--cycles` times:

* first visit of each transition: reshard time (`jax.device_put` of params + optimizer state to the new layout,
  waited for) and the compile time of the new configuration's step (`switch(..., precompile=True)`);
* later visits (everything cached): the whole `switch` call (validation + reshard + cache look-up), the
  reshard part alone, the first step after the switch and the steady step time (median of the steps after the
  first); medians over the cycles;
* the bytes that change placement (global size of the state leaves whose sharding differs).

Results go to a JSON file and a Markdown file next to it (same stem, `.md`); the table is also printed.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `tutel_jax` and `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import os  # noqa: E402

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from benchmarks.common import (LayerShape, fmt_ms, machine_info, markdown_table, quick_parser,  # noqa: E402
                               repo_root, results_path, run_and_report)
from tutel_jax import init_params  # noqa: E402
from tutel_jax.runtime import RuntimeConfig  # noqa: E402
from tutel_jax.training import MoETrainer  # noqa: E402

DEFAULT_OUT = repo_root() / "benchmarks" / "results" / "switch_cpu.json"

CYCLE = [
    ("EP 8 (s=2), r=1", RuntimeConfig.ep(8, adaptive_r=1)),
    ("EP 8 (s=2), r=2", RuntimeConfig.ep(8, adaptive_r=2)),
    ("EP 8 (s=2), r=0", RuntimeConfig.ep(8, adaptive_r=0)),
    ("EP 4 x DP 2, d=2", RuntimeConfig.ep(4, data=2, a2a_ffn_overlap_degree=2)),
    ("2DH 2x2 x DP 2", RuntimeConfig.ep_2dh(2, 2, data=2)),
    ("EP 2 x DP 4", RuntimeConfig.ep(2, data=4)),
    ("EP 1 x DP 8", RuntimeConfig.ep(1, data=8)),
    ("EP 8, top-1, cf 0.5", RuntimeConfig.ep(8, adaptive_r=1, top_k=1, capacity_factor=0.5)),
]


@dataclasses.dataclass(frozen=True)
class Settings:
    layer: LayerShape = LayerShape()
    steps_per_visit: int = 4
    cycles: int = 5


QUICK = Settings(layer=LayerShape(model_dim=64, hidden=256, tokens=16), steps_per_visit=2, cycles=2)


def _moved_bytes(trainer: MoETrainer, runtime: RuntimeConfig) -> int:
    """Global bytes of the state leaves whose sharding would change when switching to `runtime`."""
    new = trainer.state_shardings(trainer.plan(runtime))
    return sum(x.nbytes for x, s in zip(jax.tree.leaves(trainer.state), jax.tree.leaves(new))
               if not x.sharding.is_equivalent_to(s, x.ndim))


def _steps(trainer: MoETrainer, x: jax.Array, n: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        jax.block_until_ready(trainer.step(x))
        times.append(time.perf_counter() - start)
    return times[0], times[1:]


def run(settings: Settings) -> dict[str, Any]:
    config = settings.layer.config(1.0)
    params = {"moe": init_params(config, seeds=(1, 1))}

    def loss_fn(params, x, moe):
        y, aux = moe(params["moe"], x)
        return -jnp.mean(jax.nn.log_softmax(jnp.sum(y, axis=2), axis=1)[:, 0]) + 0.01 * aux.l_aux

    x = jax.random.normal(jax.random.key(0), settings.layer.batch_shape(8))
    trainer = MoETrainer(config, loss_fn, optax.adam(1e-4), params, CYCLE[0][1], deterministic=True)
    state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(trainer.state))
    first_compile_s = trainer.compile(x)
    _steps(trainer, x, settings.steps_per_visit)

    names = [name for name, _ in CYCLE]
    transitions = [(i, (i + 1) % len(CYCLE)) for i in range(len(CYCLE))]
    first: dict[tuple[int, int], dict[str, float]] = {}
    later: dict[tuple[int, int], dict[str, list[float]]] = {t: {"switch": [], "reshard": [], "first_step": [],
                                                               "steady": []} for t in transitions}
    moved: dict[tuple[int, int], int] = {}
    for cycle in range(settings.cycles + 1):
        for t in transitions:
            runtime = CYCLE[t[1]][1]
            if cycle == 0:
                moved[t] = _moved_bytes(trainer, runtime)
            start = time.perf_counter()
            report = trainer.switch(runtime, precompile=True)
            switch_s = time.perf_counter() - start
            first_step, steady = _steps(trainer, x, settings.steps_per_visit)
            if cycle == 0:
                first[t] = {"reshard_s": report.reshard_s, "compile_s": report.compile_s, "switch_s": switch_s,
                            "cached": report.cached}
            else:
                assert report.cached and report.compile_s == 0.0
                rec = later[t]
                rec["switch"].append(switch_s)
                rec["reshard"].append(report.reshard_s)
                rec["first_step"].append(first_step)
                rec["steady"].extend(steady)
    info = trainer.cache_info()
    rows = []
    for t in transitions:
        rec = later[t]
        rows.append({
            "from": names[t[0]], "to": names[t[1]], "moved_bytes": moved[t],
            "first_reshard_s": first[t]["reshard_s"], "first_compile_s": first[t]["compile_s"],
            "first_switch_s": first[t]["switch_s"], "first_cached": first[t]["cached"],
            "cached_switch_s": statistics.median(rec["switch"]), "cached_reshard_s": statistics.median(rec["reshard"]),
            "first_step_s": statistics.median(rec["first_step"]), "steady_step_s": statistics.median(rec["steady"]),
            "visits": len(rec["switch"]),
        })
    return {"machine": machine_info(), "settings": dataclasses.asdict(settings), "state_bytes": state_bytes,
            "initial_compile_s": first_compile_s, "compiles": info.compiles, "cache_hits": info.hits,
            "transitions": rows}


def to_markdown(result: dict[str, Any]) -> str:
    m, s = result["machine"], result["settings"]
    head = (
        f"Measured on {m['backend']} ({m['device_count']} devices, {m['cpu_affinity']} CPUs), jax {m['jax_version']}, "
        f"{m['date']}. One MoE layer ({LayerShape(**s['layer']).describe()}; cf 1.0, float32) + adam; state "
        f"(params + mu + nu) {result['state_bytes'] / 2**20:.1f} MiB. First visit: reshard + compile of the new "
        "configuration (`switch(precompile=True)`); the first reshard between two shardings also builds JAX's "
        f"transfer program. Cached: medians over {s['cycles']} later visits of the whole `switch` call, its reshard "
        f"part, the first step after it and the steady step (steps 2..{s['steps_per_visit']}). Moved = global bytes "
        f"of the state whose placement changes. {result['compiles']} compiles in all (one per configuration), "
        f"{result['cache_hits']} cache hits.\n\n")
    rows = []
    for r in result["transitions"]:
        rows.append([f"{r['from']} -> {r['to']}", f"{r['moved_bytes'] / 2**20:.1f}", fmt_ms(r["first_reshard_s"]),
                     f"{r['first_compile_s']:.2f}", fmt_ms(r["cached_switch_s"]), fmt_ms(r["cached_reshard_s"]),
                     fmt_ms(r["first_step_s"]), fmt_ms(r["steady_step_s"])])
    table = markdown_table(["transition", "moved MiB", "first: reshard ms", "first: compile s",
                            "cached: switch ms", "cached: reshard ms", "first step ms", "steady step ms"], rows,
                           align="lrrrrrrr")
    return head + table


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = quick_parser(__doc__, "small sizes, 2 cycles (smoke test)", DEFAULT_OUT, devices=8)
    parser.add_argument("--cycles", type=int, default=None, help="cached cycles to take medians over (default 5)")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else Settings()
    if args.cycles is not None:
        if args.cycles < 1:
            parser.error("--cycles must be >= 1")
        settings = dataclasses.replace(settings, cycles=args.cycles)
    return run_and_report(run, to_markdown, settings, results_path(args, DEFAULT_OUT))


if __name__ == "__main__":
    main()
