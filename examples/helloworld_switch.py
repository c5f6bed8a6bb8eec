#!/usr/bin/env python3
"""Runtime reconfiguration during one training run: a JAX take on Tutel's `examples/helloworld_switch.py`.

One MoE layer (Tutel's `top` gate + relu `ffn` experts, E = `--num_experts` global experts) trained with adam on
`log_softmax(sum(moe(x), axis=2), axis=1)` with Tutel's NLL-of-class-0 loss (+ `--l_aux_wt * l_aux`), over 8
devices. Every `--steps_per_config` steps the run switches, without a restart, to the next configuration of
`--schedule`: mesh layout (EP over 8 devices, EP 4 x DP 2, EP 2 x DP 4, 2DH), adaptive_r, overlap degree d,
top_k and capacity factor. Parameters and adam moments are resharded with `jax.device_put`; the compiled step is
taken from `MoETrainer`'s per-configuration cache (switching back to a configuration costs no compilation).

For each configuration it prints::

    [Switch] <configuration>: reshard = <ms> ms, compile = <s> s (cached|new), switch_time = <s> s
    STEP-<i>: loss = <loss>, step_time = <sec> sec, perf = <tflops> tflops. (f = <cf>, r = <r>, o = <d>, k = <k>)
    [Config] <configuration>: steady step_time = <sec> sec (median of the steps after the first)

and a summary table at the end. switch_time = reshard + compile (the compile is 0 for a cached configuration).

Schedule syntax (`--schedule`): configurations separated by ';', each a comma list of key=value with keys
ep (expert-axis size), dp (data-axis size), node + local (2DH expert axes instead of ep), r (adaptive_r),
d (overlap degree), k (top_k), cf (capacity factor), 2dh (0/1). ep * dp (or node * local * dp) must equal the
device count. Example::

    python examples/helloworld_switch.py --schedule "ep=8,r=1;ep=4,dp=2,d=2;ep=2,dp=4,k=1,cf=0.5;ep=8,r=1"

Sizes are small by default so that a bare run finishes in well under a minute on a 2-core CPU with 8 fake
devices (this script sets `--xla_force_host_platform_device_count=8` unless XLA_FLAGS already sets a count).
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Sequence  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from tutel_jax import init_params, make_config  # noqa: E402
from tutel_jax.runtime import parse_runtime  # noqa: E402
from tutel_jax.training import MoETrainer  # noqa: E402

DEFAULT_SCHEDULE = ("ep=8,r=1; ep=8,r=2; ep=8,r=0; ep=4,dp=2,d=2; node=2,local=2,dp=2; "
                    "ep=2,dp=4,k=1,cf=0.5; ep=8,r=1")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="helloworld_switch.py",
                                     description="Switch MoE layout / capacity / top-k during one training run.")
    parser.add_argument("--batch_size", type=int, default=2, help="samples per device (default 2)")
    parser.add_argument("--num_tokens", type=int, default=32, help="tokens per sample (default 32)")
    parser.add_argument("--model_dim", type=int, default=64)
    parser.add_argument("--hidden_size", type=int, default=128, help="hidden size per expert")
    parser.add_argument("--num_experts", type=int, default=4, help="global experts E (default 4)")
    parser.add_argument("--top", type=int, default=2, help="the gate's default k")
    parser.add_argument("--cap_factor", type=float, default=1.0, help="the gate's default capacity factor")
    parser.add_argument("--l_aux_wt", type=float, default=0.01)
    parser.add_argument("--lr", type=float, default=1e-3, help="adam learning rate")
    parser.add_argument("--steps_per_config", type=int, default=4)
    parser.add_argument("--schedule", type=str, default=DEFAULT_SCHEDULE, help="configurations, ';'-separated")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.batch_size, args.num_tokens, args.model_dim, args.hidden_size, args.num_experts, args.top,
           args.steps_per_config) < 1:
        parser.error("sizes, --top and --steps_per_config must be >= 1")
    try:
        schedule = [parse_runtime(item) for item in args.schedule.split(";") if item.strip()]
    except ValueError as exc:
        parser.error(f"argument --schedule: {exc}")
    if not schedule:
        parser.error("argument --schedule: no configuration given")
    num_devices = jax.device_count()

    config = make_config({"type": "top", "k": args.top, "capacity_factor": args.cap_factor}, args.model_dim,
                         {"type": "ffn", "count_per_node": args.num_experts, "hidden_size_per_expert": args.hidden_size,
                          "activation_fn": jax.nn.relu})
    params = {"moe": init_params(config, seeds=(1, 1))}

    def loss_fn(params, x, moe):
        y, aux = moe(params["moe"], x)
        log_probs = jax.nn.log_softmax(jnp.sum(y, axis=2), axis=1)
        return -jnp.mean(log_probs[:, 0]) + args.l_aux_wt * aux.l_aux, {"dropped": aux.dropped_fraction}

    global_batch = args.batch_size * num_devices
    x = jax.random.normal(jax.random.key(args.seed), (global_batch, args.num_tokens, args.model_dim))
    try:
        trainer = MoETrainer(config, loss_fn, optax.adam(args.lr), params, schedule[0], deterministic=True)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"[Benchmark] devices = {num_devices}, model_dim = {args.model_dim}, hidden_size = {args.hidden_size}, "
          f"samples = {global_batch * args.num_tokens}, experts = {config.num_global_experts}, "
          f"top_k = {args.top}, cf = {args.cap_factor:g}, configurations = {len(schedule)}", flush=True)

    rows, step_index = [], 0
    for i, runtime in enumerate(schedule):
        if i == 0:
            reshard_s, compile_s, cached = 0.0, trainer.compile(x), False
        else:
            try:
                report = trainer.switch(runtime, precompile=True)
            except ValueError as exc:
                print(f"[Switch] refused: {exc}", flush=True)
                continue
            reshard_s, compile_s, cached = report.reshard_s, report.compile_s, report.cached
        rt = trainer.runtime
        name = rt.describe()
        print(f"[Switch] {name}: reshard = {reshard_s * 1e3:.2f} ms, compile = {compile_s:.2f} s "
              f"({'cached' if cached else 'new'}), switch_time = {reshard_s + compile_s:.3f} s", flush=True)
        times = []
        k = rt.top_k if rt.top_k is not None else args.top
        cf = rt.capacity_factor if rt.capacity_factor is not None else args.cap_factor
        for _ in range(args.steps_per_config):
            start = time.perf_counter()
            metrics = trainer.step(x)
            loss = float(metrics["loss"])  # waits for the step
            elapsed = time.perf_counter() - start
            times.append(elapsed)
            tflops = (global_batch * args.num_tokens * args.model_dim * args.hidden_size) * 4 * 3 * \
                min(k, config.num_global_experts) * 1e-12 / elapsed
            print(f"STEP-{step_index}: loss = {loss:.5f}, step_time = {elapsed:.6f} sec, perf = {tflops:.2f} tflops. "
                  f"(f = {cf:.1f}, r = {rt.adaptive_r}, o = {rt.a2a_ffn_overlap_degree}, k = {k})", flush=True)
            step_index += 1
        steady = statistics.median(times[1:]) if len(times) > 1 else times[0]
        print(f"[Config] {name}: steady step_time = {steady:.6f} sec", flush=True)
        rows.append((name, reshard_s, compile_s, cached, steady))

    info = trainer.cache_info()
    print("\n[Summary]  reshard_ms  compile_s  cached  steady_step_ms  configuration")
    for name, reshard_s, compile_s, cached, steady in rows:
        print(f"           {reshard_s * 1e3:10.2f}  {compile_s:9.2f}  {'yes' if cached else 'no':>6}  "
              f"{steady * 1e3:14.2f}  {name}")
    print(f"[Cache] compiles = {info.compiles}, hits = {info.hits}, configurations = {len(info.configs)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
