"""MoE layer benchmark: the layer against its expert-matmul floor, and index dispatch against one-hot dispatch.

    python benchmarks/moe_layer.py [--quick] [--out benchmarks/results/moe_layer_cpu.json] [--system-malloc]
        [--no-onehot]

Three measurements, each timed with its compared variants interleaved (see `common.time_interleaved`); every
input is a jit argument (a closed-over array would be a compile-time constant that XLA can fold):

1. Layer: `moe_apply` at Tutel's helloworld size (16 x 512 tokens, model_dim 256, hidden 1024, 4 experts, top-2,
   capacity factor 1.0, float32), forward and forward+backward (`value_and_grad` of sum(y * upstream) +
   0.01 * l_aux with respect to the parameters and x).
2. Floor: the expert computation alone (`config.experts.batched`) on an [E, C, M] buffer of the same C the layer
   uses, forward and forward+backward (gradients for the expert parameters and the buffer). layer / floor is
   the overhead of gating, routing, encode and decode; a breakdown times routing and encode+decode alone.
3. Dispatch: encode + decode with the index-based `fast_encode` / `fast_decode` against the one-hot einsum
   dispatch of GShard / flaxformer (combine tensor [S, E, C] built from the same routing plan, dispatch =
   einsum('sec,sm->ecm'), combine = einsum('sec,ecm->sm')), for several E and k at S = 2048, M = 256, cf = 1.0.
   The routing plan is computed once, outside the timed region; building the combine tensor from the plan is
   inside it (it is part of that style of dispatch, as building the slot indices is part of the index one).
   Both variants return the [E, C, M] buffer as well as the combined tokens: with the tokens alone XLA fuses
   decode(encode(x)) into one gather from x and the buffer the experts need is never written.

glibc's malloc is tuned first (`common.tune_malloc`; `--system-malloc` skips it): with its defaults the multi-MiB
XLA buffers are often fresh mmaps whose page faults cost more than the dispatch itself, and come and go with
the allocator's history, which made the index timings bimodal and seemingly dependent on E.

Results go to a JSON file and a Markdown file next to it (same stem, `.md`); the tables are also printed.
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

from benchmarks.common import (Timing, fmt_ms, fmt_ratio, machine_info, markdown_table, repo_root,
                               time_interleaved, tune_malloc, write_json, write_text)
from tutel_jax import fast_decode, fast_encode, init_params, make_config, moe_apply, top_k_routing
from tutel_jax.layer import MoEConfig, route
from tutel_jax.routing import RoutingPlan

DEFAULT_OUT = repo_root() / "benchmarks" / "results" / "moe_layer_cpu.json"
LAYER_RATIO_TARGET = 1.2
DISPATCH_SPEEDUP_TARGET = 30.0
# A one-hot case whose [S, E, C] combine tensor is larger than this is not run (recorded as skipped, with why).
ONEHOT_MAX_BYTES = 2 * 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Settings:
    """Sizes and run counts of one benchmark run."""

    batch: int = 16
    seq: int = 512
    model_dim: int = 256
    hidden: int = 1024
    num_experts: int = 4
    top_k: int = 2
    capacity_factor: float = 1.0
    layer_runs: int = 15
    layer_time_budget_s: float = 6.0
    dispatch_tokens: int = 2048
    dispatch_model_dim: int = 256
    dispatch_experts: tuple[int, ...] = (4, 16, 64, 256)
    dispatch_top_ks: tuple[int, ...] = (1, 2, 8)
    dispatch_runs: int = 15
    dispatch_time_budget_s: float = 8.0
    # under a per-variant time budget, a slow variant gets fewer runs (>= min_runs), a fast one more (<= max_runs)
    min_runs: int = 3
    max_runs: int = 60
    onehot: bool = True  # time the one-hot dispatch too (--no-onehot: the index dispatch alone, much faster)


FULL = Settings()
QUICK = Settings(batch=2, seq=512, layer_runs=3, layer_time_budget_s=0.5, dispatch_tokens=512,
                 dispatch_experts=(4, 64), dispatch_top_ks=(2,), dispatch_runs=3, dispatch_time_budget_s=0.5,
                 min_runs=2, max_runs=3)


def _timings(results: dict[str, Timing]) -> dict[str, dict[str, Any]]:
    return {name: t.as_dict() for name, t in results.items()}


# ---------------------------------------------------------------------------------------------------------------
# 1 + 2: the layer and its floor


def layer_config(s: Settings) -> MoEConfig:
    """The helloworld layer: top-k gate, ffn experts, float32."""
    return make_config({"type": "top", "k": s.top_k, "capacity_factor": s.capacity_factor}, s.model_dim,
                       {"type": "ffn", "count_per_node": s.num_experts, "hidden_size_per_expert": s.hidden},
                       dtype=jnp.float32)


def bench_layer(s: Settings) -> dict[str, Any]:
    """Times the layer, its expert floor, and the layer's routing and encode+decode parts alone.

    Every input is a jit argument (nothing large is closed over), so XLA cannot constant-fold any of it.
    """
    config = layer_config(s)
    params = init_params(config, jax.random.key(0))
    keys = jax.random.split(jax.random.key(1), 5)
    x = jax.random.normal(keys[0], (s.batch, s.seq, s.model_dim), jnp.float32)
    upstream = jax.random.normal(keys[1], (s.batch, s.seq, config.output_dim), jnp.float32)
    tokens = x.reshape(-1, s.model_dim)
    token_upstream = upstream.reshape(-1, config.output_dim)

    plan, _ = jax.jit(lambda p, t: route(p, t, config))(params["gates"][0], tokens)
    capacity = plan.buffer_capacity
    buf = jax.random.normal(keys[2], (s.num_experts, capacity, s.model_dim), jnp.float32)
    buf_upstream = jax.random.normal(keys[3], (s.num_experts, capacity, config.output_dim), jnp.float32)
    slot_upstream = jax.random.normal(keys[4], (s.num_experts, capacity, s.model_dim), jnp.float32)

    def layer_loss(p, x_, u):
        y, aux = moe_apply(p, x_, config)
        return jnp.sum(y * u) + 0.01 * aux.l_aux

    def floor_loss(expert_params, b, u):
        return jnp.sum(config.experts.batched(expert_params, b) * u)

    def routing_loss(gate_params, t):  # gate matmul + softmax + top-k routing + aux loss, no data movement
        p, l_aux = route(gate_params, t, config)
        return jnp.sum(p.gates) + 0.01 * l_aux

    layer_fwd = jax.jit(lambda p, x_: moe_apply(p, x_, config))
    layer_bwd = jax.jit(jax.value_and_grad(layer_loss, argnums=(0, 1)))
    floor_fwd = jax.jit(config.experts.batched)
    floor_bwd = jax.jit(jax.value_and_grad(floor_loss, argnums=(0, 1)))
    routing_fwd = jax.jit(lambda p, t: route(p, t, config))
    routing_bwd = jax.jit(jax.value_and_grad(routing_loss, argnums=(0, 1)))

    gate_params = params["gates"][0]
    timing = dict(runs=s.layer_runs, time_budget_s=s.layer_time_budget_s, min_runs=s.min_runs, max_runs=s.max_runs)
    forward = time_interleaved({
        "layer": lambda: layer_fwd(params, x),
        "floor": lambda: floor_fwd(params["experts"], buf),
        "routing": lambda: routing_fwd(gate_params, tokens),
        "encode_decode": lambda: INDEX_FWD(tokens, plan),
    }, **timing)
    backward = time_interleaved({
        "layer": lambda: layer_bwd(params, x, upstream),
        "floor": lambda: floor_bwd(params["experts"], buf, buf_upstream),
        "routing": lambda: routing_bwd(gate_params, tokens),
        "encode_decode": lambda: INDEX_BWD(tokens, plan.gates, plan, token_upstream, slot_upstream),
    }, **timing)

    def summary(t: dict[str, Timing]) -> dict[str, Any]:
        floor = t["floor"].median_s
        return {
            "timings": _timings(t),
            "layer_over_floor": t["layer"].median_s / floor,
            "routing_over_floor": t["routing"].median_s / floor,
            "encode_decode_over_floor": t["encode_decode"].median_s / floor,
        }

    tokens_count = s.batch * s.seq
    flops_fwd = 2 * 2 * s.num_experts * capacity * s.model_dim * s.hidden  # two matmuls
    return {
        "config": {
            "tokens": tokens_count, "batch": s.batch, "seq": s.seq, "model_dim": s.model_dim, "hidden": s.hidden,
            "num_experts": s.num_experts, "top_k": s.top_k, "capacity_factor": s.capacity_factor,
            "capacity": capacity, "dtype": "float32", "expert_matmul_gflop_forward": flops_fwd / 1e9,
        },
        "forward": summary(forward),
        "forward_backward": summary(backward),
        "target_layer_over_floor": LAYER_RATIO_TARGET,
    }


# ---------------------------------------------------------------------------------------------------------------
# 3: dispatch, index versus one-hot


def onehot_tensors(plan: RoutingPlan, dtype: Any = jnp.float32) -> tuple[jax.Array, jax.Array]:
    """GShard / flaxformer dispatch mask and combine tensor, both [S, E, C], from a routing plan.

    combine[s, e, c] = gate of the choice of token s that took slot c of expert e (0 if none or dropped);
    dispatch = combine > 0 (as flaxformer does: `combine_array.astype(bool)`).
    """
    cap = plan.buffer_capacity
    expert_1h = jax.nn.one_hot(plan.expert_ids, plan.num_experts, dtype=dtype)  # [k, S, E]
    location = jnp.where(plan.kept, plan.locations, cap)  # a dropped choice gets an all-zero one-hot row
    location_1h = jax.nn.one_hot(location, cap, dtype=dtype)  # [k, S, C]
    combine = jnp.einsum("ks,kse,ksc->sec", plan.gates.astype(dtype), expert_1h, location_1h)
    dispatch = (combine > 0).astype(dtype)
    return dispatch, combine


def onehot_dispatch(x: jax.Array, plan: RoutingPlan) -> tuple[jax.Array, jax.Array]:
    """One-hot einsum dispatch + combine of x [S, M] -> (buffer [E, C, M], tokens [S, M]); gates at combine."""
    dispatch, combine = onehot_tensors(plan, x.dtype)
    buf = jnp.einsum("sec,sm->ecm", dispatch, x)
    return buf, jnp.einsum("sec,ecm->sm", combine, buf)


def index_dispatch(x: jax.Array, plan: RoutingPlan) -> tuple[jax.Array, jax.Array]:
    """Index-based dispatch + combine (the library's fast_encode / fast_decode) -> (buffer, tokens).

    The buffer is returned, not only the tokens: otherwise XLA fuses decode(encode(x)) into a single gather from
    x and the [E, C, M] buffer, which the experts need in a real layer, is never written.
    """
    buf = fast_encode(x, plan)
    return buf, fast_decode(buf, plan)


DispatchFn = Callable[[jax.Array, RoutingPlan], tuple[jax.Array, jax.Array]]


def dispatch_loss(fn: DispatchFn) -> Callable[..., jax.Array]:
    """loss(x, gates, plan, token_upstream, slot_upstream) = <tokens, token_upstream> + <buffer, slot_upstream>.

    Both ends of the buffer get a cotangent, as in a layer (the experts' backward feeds the buffer's, decode's
    feeds the experts'); differentiate w.r.t. x (argnum 0) and the gates (argnum 1).
    """
    def loss(x, gates, plan, token_upstream, slot_upstream):
        buf, y = fn(x, dataclasses.replace(plan, gates=gates))
        return jnp.sum(y * token_upstream) + jnp.sum(buf * slot_upstream)
    return loss


@dataclasses.dataclass(frozen=True)
class DispatchInputs:
    """One dispatch case's inputs; the routing plan is computed here, outside any timed region."""

    plan: RoutingPlan
    x: jax.Array
    token_upstream: jax.Array
    slot_upstream: jax.Array

    @property
    def forward_args(self) -> tuple:
        return self.x, self.plan

    @property
    def backward_args(self) -> tuple:  # the arguments of dispatch_loss
        return self.x, self.plan.gates, self.plan, self.token_upstream, self.slot_upstream


def dispatch_inputs(s: Settings, num_experts: int, top_k: int) -> DispatchInputs:
    """Deterministic inputs of the (E, k) case: random softmax scores routed with top-k at the capacity factor."""
    num_tokens, dim = s.dispatch_tokens, s.dispatch_model_dim
    keys = jax.random.split(jax.random.key(10 + num_experts), 4)
    scores = jax.nn.softmax(jax.random.normal(keys[0], (num_tokens, num_experts), jnp.float32), axis=-1)
    plan = jax.jit(lambda sc: top_k_routing(sc, top_k, s.capacity_factor))(scores)
    inputs = DispatchInputs(
        plan=plan,
        x=jax.random.normal(keys[1], (num_tokens, dim), jnp.float32),
        token_upstream=jax.random.normal(keys[2], (num_tokens, dim), jnp.float32),
        slot_upstream=jax.random.normal(keys[3], (num_experts, plan.buffer_capacity, dim), jnp.float32),
    )
    return jax.block_until_ready(inputs)


INDEX_FWD = jax.jit(index_dispatch)
INDEX_BWD = jax.jit(jax.value_and_grad(dispatch_loss(index_dispatch), argnums=(0, 1)))
ONEHOT_FWD = jax.jit(onehot_dispatch)
ONEHOT_BWD = jax.jit(jax.value_and_grad(dispatch_loss(onehot_dispatch), argnums=(0, 1)))


def bench_dispatch_case(s: Settings, num_experts: int, top_k: int) -> dict[str, Any]:
    """Times index vs one-hot dispatch, forward and forward+backward, for one (E, k)."""
    inp = dispatch_inputs(s, num_experts, top_k)
    plan, num_tokens, cap = inp.plan, s.dispatch_tokens, inp.plan.buffer_capacity
    onehot_bytes = num_tokens * num_experts * cap * 4
    case: dict[str, Any] = {
        "num_experts": num_experts, "top_k": top_k, "effective_top_k": plan.top_k, "capacity": cap,
        "dropped_fraction": float(plan.dropped_fraction), "onehot_tensor_bytes": onehot_bytes,
    }
    fwd = {"index": lambda: INDEX_FWD(*inp.forward_args)}
    bwd = {"index": lambda: INDEX_BWD(*inp.backward_args)}
    if not s.onehot:
        case["onehot_skipped"] = "not measured (--no-onehot)"
    elif onehot_bytes > ONEHOT_MAX_BYTES:
        case["onehot_skipped"] = (f"one-hot combine tensor [S={num_tokens}, E={num_experts}, C={cap}] needs "
                                  f"{onehot_bytes / 2 ** 30:.1f} GiB > {ONEHOT_MAX_BYTES / 2 ** 30:.1f} GiB")
    else:
        # the two implementations must agree before their times mean anything
        for a, b in zip(INDEX_FWD(*inp.forward_args), ONEHOT_FWD(*inp.forward_args)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
        fwd["onehot"] = lambda: ONEHOT_FWD(*inp.forward_args)
        bwd["onehot"] = lambda: ONEHOT_BWD(*inp.backward_args)

    for name, variants in (("forward", fwd), ("forward_backward", bwd)):
        t = time_interleaved(variants, s.dispatch_runs, time_budget_s=s.dispatch_time_budget_s,
                             min_runs=s.min_runs, max_runs=s.max_runs)
        entry: dict[str, Any] = {"timings": _timings(t)}
        if "onehot" in t:
            entry["speedup"] = t["onehot"].median_s / t["index"].median_s
        case[name] = entry
    return case


def bench_index_flatness(s: Settings) -> dict[str, dict[str, Any]]:
    """Per k: the index dispatch at every E (where k is not clipped to E), timed interleaved across E.

    E * C = k * S for every E here, so the index work is the same and max / min over E should stay near 1.
    The E are interleaved with each other (not with the one-hot variant), so that a busy machine cannot fake
    or hide a trend in E.
    """
    flatness: dict[str, dict[str, Any]] = {}
    for top_k in s.dispatch_top_ks:
        experts = [e for e in s.dispatch_experts if e >= top_k]
        if len(experts) < 2:
            continue
        inputs = {e: dispatch_inputs(s, e, top_k) for e in experts}
        entry: dict[str, Any] = {"E": experts}
        for phase, fn, args in (("forward", INDEX_FWD, "forward_args"),
                                ("forward_backward", INDEX_BWD, "backward_args")):
            t = time_interleaved({f"E={e}": (lambda e=e: fn(*getattr(inputs[e], args))) for e in experts},
                                 s.dispatch_runs, time_budget_s=s.dispatch_time_budget_s / 4,
                                 min_runs=s.min_runs, max_runs=s.max_runs)
            medians = [t[f"E={e}"].median_s for e in experts]
            entry[phase] = {"timings": _timings(t), "max_over_min": max(medians) / min(medians)}
        flatness[str(top_k)] = entry
    return flatness


def bench_dispatch(s: Settings, log: Callable[[str], None]) -> dict[str, Any]:
    """All (E, k) dispatch cases, plus how flat the index dispatch is in E."""
    cases = []
    for top_k in s.dispatch_top_ks:
        for num_experts in s.dispatch_experts:
            start = time.perf_counter()
            case = bench_dispatch_case(s, num_experts, top_k)
            cases.append(case)
            log(f"  dispatch E={num_experts:4d} k={top_k}: index fwd "
                f"{fmt_ms(case['forward']['timings']['index']['median_s'])} ms, speedup fwd "
                f"{fmt_ratio(case['forward'].get('speedup', float('nan')))} fwd+bwd "
                f"{fmt_ratio(case['forward_backward'].get('speedup', float('nan')))} "
                f"({time.perf_counter() - start:.1f} s)")
    return {
        "config": {"tokens": s.dispatch_tokens, "model_dim": s.dispatch_model_dim,
                   "capacity_factor": s.capacity_factor, "dtype": "float32", "is_postscore": True},
        "cases": cases,
        "index_flatness_in_E": bench_index_flatness(s),
        "target_speedup_at_largest_case": DISPATCH_SPEEDUP_TARGET,
    }


# ---------------------------------------------------------------------------------------------------------------
# report


def checks(result: dict[str, Any]) -> dict[str, Any]:
    """The targets: layer / floor <= 1.2 (both passes), one-hot / index >= 30x at the largest (E, k)."""
    layer = result["layer"]
    largest = max(result["dispatch"]["cases"], key=lambda c: (c["top_k"], c["num_experts"]))
    out: dict[str, Any] = {
        "layer_over_floor": {phase: layer[phase]["layer_over_floor"] for phase in ("forward", "forward_backward")},
        "dispatch_case": {"num_experts": largest["num_experts"], "top_k": largest["top_k"]},
        "dispatch_speedup": {phase: largest[phase].get("speedup") for phase in ("forward", "forward_backward")},
    }
    out["layer_ok"] = all(r <= LAYER_RATIO_TARGET for r in out["layer_over_floor"].values())
    out["dispatch_ok"] = all(v is not None and v >= DISPATCH_SPEEDUP_TARGET for v in out["dispatch_speedup"].values())
    # the targets are for the full sizes, not the --quick ones, and the dispatch one needs the one-hot timings
    out["applicable"] = not result["quick"] and result["settings"]["onehot"]
    return out


def _case_experts(dispatch: dict[str, Any]) -> list[int]:
    """The E of the dispatch cases, in order."""
    return sorted({c["num_experts"] for c in dispatch["cases"]})


def render_markdown(result: dict[str, Any]) -> str:
    """The Markdown report: machine line, layer table, dispatch table."""
    m = result["machine"]
    layer = result["layer"]
    cfg = layer["config"]
    lines = [
        f"Measured on {m['backend']} ({m['device_kind']}, {m['cpu_count']} CPUs), jax {m['jax_version']}, "
        f"{m['date']}{' (quick smoke run)' if result['quick'] else ''}. Median of interleaved runs "
        f"(number of runs in parentheses), compile excluded, every input a jit argument. Allocator: "
        f"{m['allocator']}{' (env ' + m['allocator_env'] + ')' if m['allocator_env'] else ''}.\n",
        f"**Layer vs expert floor**: {cfg['batch']}x{cfg['seq']} tokens, model_dim {cfg['model_dim']}, "
        f"hidden {cfg['hidden']}, {cfg['num_experts']} experts, top-{cfg['top_k']}, cf {cfg['capacity_factor']}, "
        f"C = {cfg['capacity']}, float32. Floor = `experts.batched` on the [E, C, M] buffer alone; routing = gate "
        f"+ softmax + top-k routing + aux loss; encode+decode = `fast_encode` + `fast_decode` with the buffer "
        f"materialized (as `index` in the dispatch table below).\n",
    ]
    rows = []
    for phase, label in (("forward", "forward"), ("forward_backward", "forward+backward")):
        e = layer[phase]
        t = e["timings"]
        rows.append([
            label,
            f"{fmt_ms(t['layer']['median_s'])} ({t['layer']['runs']})",
            f"{fmt_ms(t['floor']['median_s'])} ({t['floor']['runs']})",
            f"**{e['layer_over_floor']:.2f}**",
            f"{fmt_ms(t['routing']['median_s'])} ({e['routing_over_floor']:.2f})",
            f"{fmt_ms(t['encode_decode']['median_s'])} ({e['encode_decode_over_floor']:.2f})",
        ])
    lines.append(markdown_table(
        ["pass", "layer ms", "floor ms", f"layer / floor (target <= {LAYER_RATIO_TARGET})",
         "routing ms (/ floor)", "encode+decode ms (/ floor)"], rows, "lrrrrr"))
    d = result["dispatch"]
    dc = d["config"]
    lines.append(
        f"**Dispatch: index (`fast_encode`/`fast_decode`) vs one-hot einsum** (combine tensor [S, E, C] built from "
        f"the plan, `einsum('sec,sm->ecm')`, `einsum('sec,ecm->sm')`): S = {dc['tokens']} tokens, "
        f"M = {dc['model_dim']}, cf {dc['capacity_factor']}, float32, C = k * ceil(S / E) (k clipped to E). "
        f"Both return the [E, C, M] buffer and the combined tokens; forward+backward = `value_and_grad` of "
        f"<tokens, u> + <buffer, v> w.r.t. x and the gates. Routing plan computed outside the timed region.")
    rows = []
    for c in d["cases"]:
        row = [c["num_experts"], c["top_k"] if c["effective_top_k"] == c["top_k"] else
               f"{c['top_k']} (-> {c['effective_top_k']})", c["capacity"]]
        for phase in ("forward", "forward_backward"):
            t = c[phase]["timings"]
            row.append(f"{fmt_ms(t['index']['median_s'])} ({t['index']['runs']})")
            if "onehot" in t:
                row += [f"{fmt_ms(t['onehot']['median_s'])} ({t['onehot']['runs']})",
                        f"**{fmt_ratio(c[phase]['speedup'])}**"]
            else:
                row += ["skipped", "-"]
        rows.append(row)
    lines.append(markdown_table(
        ["E", "k", "C", "index fwd ms", "one-hot fwd ms", "speedup fwd", "index fwd+bwd ms", "one-hot fwd+bwd ms",
         "speedup fwd+bwd"], rows))
    flat = d["index_flatness_in_E"]
    rows = []
    for k, v in flat.items():
        for phase, label in (("forward", "fwd"), ("forward_backward", "fwd+bwd")):
            t = v[phase]["timings"]
            rows.append([k, label] + [f"{fmt_ms(t[f'E={e}']['median_s'])} ({t[f'E={e}']['runs']})"
                                      if f"E={e}" in t else "-" for e in _case_experts(d)]
                        + [f"**{v[phase]['max_over_min']:.2f}**"])
    lines.append("**Index dispatch flatness in E**: the index rows again, with the E of each k interleaved with "
                 "each other (not with one-hot); E * C = k * S at every E, so the ratio should stay near 1.")
    lines.append(markdown_table(["k", "pass"] + [f"E={e} ms" for e in _case_experts(d)] + ["max / min"], rows,
                                "ll" + "r" * (len(_case_experts(d)) + 1)))
    c = result["checks"]
    e, k = c["dispatch_case"]["num_experts"], c["dispatch_case"]["top_k"]
    speedups = " / ".join(fmt_ratio(v) if v is not None else "n/a" for v in c["dispatch_speedup"].values())
    lines.append(f"Targets: layer / floor <= {LAYER_RATIO_TARGET}: {'met' if c['layer_ok'] else 'NOT met'}; "
                 f"index over one-hot speedup >= {DISPATCH_SPEEDUP_TARGET:.0f}x at E={e}, k={k} (forward / "
                 f"forward+backward {speedups}): {'met' if c['dispatch_ok'] else 'NOT met'}"
                 f"{'' if c['applicable'] else ' (not applicable: the targets are for the full run with one-hot)'}.")
    skipped = [c for c in d["cases"] if "onehot_skipped" in c]
    for c in skipped:
        lines.append(f"One-hot skipped at E={c['num_experts']}, k={c['top_k']}: {c['onehot_skipped']}.\n")
    return "\n\n".join(block.strip("\n") for block in lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few runs (smoke test, < 1 min)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON output; the Markdown table goes next to it as .md (default {DEFAULT_OUT}, "
                             "or a _quick variant with --quick)")
    parser.add_argument("--system-malloc", action="store_true",
                        help="keep glibc's default malloc settings (page-fault noise on large buffers; see "
                             "common.tune_malloc)")
    parser.add_argument("--no-onehot", dest="onehot", action="store_false",
                        help="time the index dispatch alone, not the (slow) one-hot reference")
    args = parser.parse_args(argv)
    if not args.system_malloc:
        tune_malloc()
    settings = dataclasses.replace(QUICK if args.quick else FULL, onehot=args.onehot)
    out = args.out or (DEFAULT_OUT.with_name("moe_layer_cpu_quick.json") if args.quick else DEFAULT_OUT)

    def log(msg: str) -> None:
        print(msg, flush=True)

    start = time.perf_counter()
    log(f"moe_layer benchmark ({'quick' if args.quick else 'full'}) on {jax.default_backend()}")
    layer = bench_layer(settings)
    log(f"  layer: forward layer/floor {layer['forward']['layer_over_floor']:.2f}, forward+backward "
        f"{layer['forward_backward']['layer_over_floor']:.2f} ({time.perf_counter() - start:.1f} s)")
    dispatch = bench_dispatch(settings, log)
    result = {
        "benchmark": "moe_layer",
        "quick": args.quick,
        "machine": machine_info(),
        "settings": dataclasses.asdict(settings),
        "timing": "median of runs interleaved in rounds, after one compiling call and one warm-up call; a "
                  "per-variant time budget sets the run count (min_runs..max_runs); jax.block_until_ready around "
                  "each call; all inputs passed as jit arguments",
        "layer": layer,
        "dispatch": dispatch,
        "checks": None,
        "wall_time_s": None,
    }
    result["checks"] = checks(result)
    result["wall_time_s"] = round(time.perf_counter() - start, 1)
    markdown = render_markdown(result)
    write_json(out, result)
    write_text(out.with_suffix(".md"), markdown)
    log("\n" + markdown)
    log(f"wrote {out} and {out.with_suffix('.md')} ({result['wall_time_s']} s)")
    return result


if __name__ == "__main__":
    main()
