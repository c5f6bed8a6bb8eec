"""Expert-parallel step time on 8 (fake CPU) devices versus one device, side by side in one run.

The same global batch and the same layer (E experts, top-2) trained with forward+backward:
  - `1 device`: `moe_apply` on the whole batch on one device;
  - `EP 8`: `moe_apply_parallel` with one expert group of 8 devices (flat all_to_all), and variants with
    overlap degree 2, 2DH on a (2, 4) grid, and adaptive r = 0 (data parallel, no all_to_all).
On a CPU the 8 devices share the machine's cores, so the ratio measures the overhead of the parallel layout
(collectives, per-device routing) rather than a speed-up; on accelerators each device has its own compute.

    python benchmarks/expert_parallel.py [--quick] [--out benchmarks/results/expert_parallel_cpu.json]
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (fmt_ms, fmt_ratio, machine_info, markdown_table, repo_root,  # noqa: E402
                               time_interleaved, write_json, write_text)
from tutel_jax import init_params, make_config, moe_apply  # noqa: E402
from tutel_jax.parallel import ExpertParallel, moe_apply_parallel, shard_params  # noqa: E402


def step_fn(apply, up):
    """jit(value_and_grad) of sum(y * up) + 0.01 * l_aux w.r.t. params and x."""
    def loss(params, x):
        y, aux = apply(params, x)
        return jnp.sum(y * up) + 0.01 * aux.l_aux
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few runs (smoke test)")
    parser.add_argument("--out", default=str(repo_root() / "benchmarks/results/expert_parallel_cpu.json"))
    args = parser.parse_args(argv)
    W = 8
    if len(jax.devices()) < W:
        parser.error(f"needs {W} devices, found {len(jax.devices())}")
    batch, tokens, M, H = (8, 32, 32, 64) if args.quick else (8, 512, 256, 1024)
    runs = 2 if args.quick else 7
    devices = np.array(jax.devices()[:W])
    flat = ExpertParallel(Mesh(devices, ("expert",)))
    grid = ExpertParallel(Mesh(devices.reshape(2, 4), ("node", "local")), expert_axes=("node", "local"))

    def config(n, world):
        return make_config({"type": "top", "k": 2, "capacity_factor": 1.0}, M,
                           {"type": "ffn", "count_per_node": n, "hidden_size_per_expert": H}, world_size=world)

    single_cfg, ep_cfg = config(W, 1), config(1, W)
    params = init_params(single_cfg, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (batch, tokens, M))
    up = jax.random.normal(jax.random.key(2), x.shape)
    ep_params = shard_params(params, flat)
    grid_params = shard_params(params, grid)
    variants = {
        "1 device": (step_fn(lambda p, x: moe_apply(p, x, single_cfg), up), params),
        "EP 8 (flat)": (step_fn(lambda p, x: moe_apply_parallel(p, x, ep_cfg, flat), up), ep_params),
        "EP 8, overlap d=2": (step_fn(lambda p, x: moe_apply_parallel(p, x, ep_cfg, flat, a2a_ffn_overlap_degree=2),
                                      up), ep_params),
        "EP 8, 2DH (2x4)": (step_fn(lambda p, x: moe_apply_parallel(p, x, ep_cfg, grid, use_2dh=True), up),
                            grid_params),
        "8 devices, r=0 (data parallel)": (step_fn(lambda p, x: moe_apply_parallel(p, x, ep_cfg, flat, adaptive_r=0),
                                                   up), ep_params),
    }
    timings = time_interleaved({name: (lambda f=f, p=p: f(p, x)) for name, (f, p) in variants.items()}, runs)
    base = timings["1 device"].median_s
    rows = [[name, fmt_ms(t.median_s), t.runs, fmt_ratio(t.median_s / base)] for name, t in timings.items()]
    info = machine_info()
    table = markdown_table(["layout", "fwd+bwd step ms", "runs", "time / 1 device"], rows, "lrrr")
    header = (f"Expert-parallel step time: {batch} x {tokens} tokens, model_dim {M}, hidden {H}, {W} experts, top-2, "
              f"cf 1.0, float32; {info.get('backend')} with {W} devices on {info.get('cpu_count')} CPU cores "
              f"(jax {jax.__version__}). Median of interleaved runs, compile excluded.\n\n")
    print(header + table)
    result = {"machine": info, "settings": {"batch": batch, "tokens": tokens, "model_dim": M, "hidden": H,
                                            "experts": W, "top_k": 2},
              "timings": {name: t.as_dict() for name, t in timings.items()}}
    out = Path(args.out)
    write_json(out, result)
    write_text(out.with_suffix(".md"), header + table + "\n")
    return result


if __name__ == "__main__":
    main()
