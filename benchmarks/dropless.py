"""Dropless vs capacity MoE layer on CPU: the ragged path, the bucketed path and Tutel's capacity path.

    python benchmarks/dropless.py [--quick] [--out benchmarks/results/dropless_cpu.json] [--system-malloc]

For E in {8, 64, 256} and k in {2, 8} (S tokens, model_dim M, SwiGLU experts of hidden H, a Mixtral router with
random weights, float32), three variants of `moe_apply`, forward and forward+backward (`value_and_grad` of
sum(y * upstream) + 0.01 * l_aux with respect to the parameters and x), timed interleaved (`common.time_interleaved`):

  capacity  capacity_factor = 1.0: Tutel's fixed capacity C = k * ceil(S / E); drops what overflows;
  ragged    capacity_factor = 0, dropless_impl='ragged': permute, `lax.ragged_dot`, unpermute (no padding);
  bucketed  capacity_factor = 0, dropless_impl='bucketed': the capacity path at the smallest static bucket
            >= the max per-expert count (ceil(k*S/E) x 1, 1.25, 1.5, 2, 3, 4; ragged beyond).

Reported with each: slots computed / assignments (E * C / (k * S); 1.0 for ragged), dropped fraction, and the
largest |y_bucketed - y_ragged| (they must agree: both are dropless). `lax.ragged_dot` is dense-masked on XLA:CPU,
so its cost grows with E * k * S * M * H rather than k * S * M * H.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: make `tutel_jax` and `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (fmt_ms, fmt_ratio, machine_info, markdown_table, repo_root, time_interleaved,
                               tune_malloc, write_json, write_text)
from tutel_jax import init_params, make_config, moe_apply
from tutel_jax.experts import bucket_capacities, bucket_index

DEFAULT_OUT = repo_root() / "benchmarks" / "results" / "dropless_cpu.json"
VARIANTS = ("capacity", "ragged", "bucketed")


@dataclasses.dataclass(frozen=True)
class Settings:
    tokens: int = 1024
    model_dim: int = 128
    hidden: int = 128
    experts: tuple[int, ...] = (8, 64, 256)
    top_ks: tuple[int, ...] = (2, 8)
    runs: int = 10
    time_budget_s: float = 3.0
    min_runs: int = 3
    max_runs: int = 30
    backward: bool = True


FULL = Settings()
QUICK = Settings(tokens=256, model_dim=32, hidden=32, experts=(8, 64), top_ks=(2,), runs=2, time_budget_s=0.2,
                 min_runs=2, max_runs=3)


def _configs(s: Settings, num_experts: int, top_k: int):
    kw = dict(gate_type={"type": "mixtral", "k": top_k}, model_dim=s.model_dim,
              experts={"type": "swiglu", "count_per_node": num_experts, "hidden_size_per_expert": s.hidden})
    return {"capacity": (make_config(**kw), 1.0), "ragged": (make_config(**kw, dropless_impl="ragged"), 0.0),
            "bucketed": (make_config(**kw, dropless_impl="bucketed"), 0.0)}


def bench_case(s: Settings, num_experts: int, top_k: int) -> dict[str, Any]:
    configs = _configs(s, num_experts, top_k)
    params = init_params(configs["capacity"][0], jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (s.tokens, s.model_dim), jnp.float32)
    up = jax.random.normal(jax.random.key(2), (s.tokens, s.model_dim), jnp.float32)
    fwd: dict[str, Callable] = {}
    bwd: dict[str, Callable] = {}
    stats: dict[str, dict[str, Any]] = {}
    outputs = {}
    for name, (config, cf) in configs.items():
        f = jax.jit(lambda p, x, config=config, cf=cf: moe_apply(p, x, config, capacity_factor=cf))
        y, aux = f(params, x)
        outputs[name] = np.asarray(y)
        counts = np.asarray(aux.dispatch_count)
        if name == "capacity":
            slots = num_experts * int(aux.capacity)
        elif name == "bucketed":
            caps = bucket_capacities(s.tokens, num_experts, top_k)
            i = int(bucket_index(jnp.asarray(counts.max()), caps))
            slots = num_experts * caps[i] if i < len(caps) else top_k * s.tokens
        else:
            slots = top_k * s.tokens
        stats[name] = {"slots_over_assignments": slots / (top_k * s.tokens),
                       "dropped_fraction": float(aux.dropped_fraction), "max_count": int(counts.max()),
                       "balanced_count": -(-top_k * s.tokens // num_experts)}

        def loss(p, x, config=config, cf=cf):
            y, aux = moe_apply(p, x, config, capacity_factor=cf)
            return jnp.sum(y * up) + 0.01 * aux.l_aux

        fwd[name] = (lambda f=f: f(params, x))
        g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        bwd[name] = (lambda g=g: g(params, x))
    common = dict(time_budget_s=s.time_budget_s, min_runs=s.min_runs, max_runs=s.max_runs)
    forward = time_interleaved(fwd, s.runs, **common)
    backward = time_interleaved(bwd, s.runs, **common) if s.backward else None
    return {
        "num_experts": num_experts, "top_k": top_k, "stats": stats,
        "max_abs_bucketed_minus_ragged": float(np.abs(outputs["bucketed"] - outputs["ragged"]).max()),
        "forward": {k: v.as_dict() for k, v in forward.items()},
        "forward_backward": None if backward is None else {k: v.as_dict() for k, v in backward.items()},
    }


def render_markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = ["# Dropless vs capacity MoE layer on CPU\n",
             f"S = {s['tokens']} tokens, M = {s['model_dim']}, SwiGLU hidden H = {s['hidden']}, Mixtral router "
             f"(random weights), float32; median ms of interleaved runs (`benchmarks/dropless.py`). "
             f"{result['machine']['cpu_count']} CPUs, JAX {result['machine']['jax_version']} "
             f"({result['machine']['backend']}).\n",
             "slots/assign. = expert rows computed per routed assignment (padding; ragged computes exactly the "
             "assignments, but `lax.ragged_dot` is dense-masked on XLA:CPU, so it does E times the FLOPs). "
             "capacity = Tutel's cf = 1.0, which drops the overflow.\n"]
    headers = ["E", "k", "pass", "capacity ms", "ragged ms", "bucketed ms", "ragged / capacity",
               "bucketed / capacity", "ragged / bucketed", "capacity dropped", "slots/assign. cap. / bucketed"]
    rows = []
    for case in result["cases"]:
        st = case["stats"]
        for label, key in (("fwd", "forward"), ("fwd+bwd", "forward_backward")):
            t = case[key]
            if t is None:
                continue
            ms = {v: t[v]["median_s"] for v in VARIANTS}
            rows.append([case["num_experts"], case["top_k"], label, fmt_ms(ms["capacity"]), fmt_ms(ms["ragged"]),
                         fmt_ms(ms["bucketed"]), fmt_ratio(ms["ragged"] / ms["capacity"]),
                         fmt_ratio(ms["bucketed"] / ms["capacity"]), fmt_ratio(ms["ragged"] / ms["bucketed"]),
                         f"{st['capacity']['dropped_fraction']:.1%}",
                         f"{st['capacity']['slots_over_assignments']:.2f} / "
                         f"{st['bucketed']['slots_over_assignments']:.2f}"])
    lines.append(markdown_table(headers, rows))
    worst = max(c["max_abs_bucketed_minus_ragged"] for c in result["cases"])
    lines.append(f"\nLargest |y_bucketed - y_ragged| over all cases: {worst:.2e} (both dropless).\n")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few runs (smoke test)")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON output (default {DEFAULT_OUT}); .md next to it")
    parser.add_argument("--system-malloc", action="store_true", help="keep glibc's default malloc settings")
    args = parser.parse_args(argv)
    if not args.system_malloc:
        tune_malloc()
    settings = QUICK if args.quick else FULL
    out = args.out or (DEFAULT_OUT.with_name("dropless_cpu_quick.json") if args.quick else DEFAULT_OUT)
    start = time.perf_counter()
    cases = []
    for num_experts in settings.experts:
        for top_k in settings.top_ks:
            t0 = time.perf_counter()
            cases.append(bench_case(settings, num_experts, top_k))
            print(f"E={num_experts} k={top_k}: " + ", ".join(
                f"{v} {fmt_ms(cases[-1]['forward'][v]['median_s'])} ms" for v in VARIANTS)
                + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    result = {"benchmark": "dropless", "quick": args.quick, "machine": machine_info(),
              "settings": dataclasses.asdict(settings),
              "timing": "median of runs interleaved in rounds after a compiling and a warm-up call; per-variant "
                        "time budget; jax.block_until_ready around each call; inputs passed as jit arguments",
              "cases": cases, "wall_time_s": round(time.perf_counter() - start, 1)}
    markdown = render_markdown(result)
    write_json(out, result)
    write_text(out.with_suffix(".md"), markdown)
    print("\n" + markdown)
    return result


if __name__ == "__main__":
    main()
