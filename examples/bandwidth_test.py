#!/usr/bin/env python3
"""Collective bandwidth test: a JAX port of Tutel's `tutel.examples.bandwidth_test`.

Tutel's script times `net.simple_all_to_all` on a float32 buffer of `--size_mb` MB per rank, forever, and prints
`AllToAll bandwidth across <W> node(s) = <GB/s>`. This port times, over all (or `--devices`) local devices:

  * ``all_to_all``      the expert all_to_all of MoE dispatch, flat:
                        `tutel_jax.parallel.expert_all_to_all(buf, 'world', use_2dh=False)` on a 1-D mesh;
  * ``all_to_all_2dh``  the same exchange, 2-D hierarchical: `expert_all_to_all(buf, ('node', 'local'),
                        use_2dh=True)` on a (W / L, L) mesh of the same devices (L = `--node_size`, node-major);
  * ``all_gather``      `jax.lax.all_gather(tiled=True)` over the 1-D mesh;
  * ``all_reduce``      `jax.lax.psum` over the 1-D mesh;
  * ``reduce_scatter``  `jax.lax.psum_scatter(tiled=True)` over the 1-D mesh.

Each op is a jitted `jax.shard_map`; one call is timed from dispatch to `jax.block_until_ready` of its output.
The per-device buffer is [E, C, M] with E = W experts (one local expert per device) and C * M chosen so that it
holds `--size_mb` MB (1 MB = 2**20 bytes, as in Tutel; rounded down to a whole [E, C, M]). Every op moves a
buffer of that size S per device, counted like NCCL-tests does: S is the all_to_all / all_reduce buffer, the
all_gather OUTPUT and the reduce_scatter INPUT. Reported per op (W = number of devices, GB = 1e9 bytes):

    time    median seconds per call over `--loop` timed calls (after `--warmup` untimed ones)
    algbw   S / time
    busbw   algbw * factor, factor = (W - 1) / W for all_to_all, all_gather, reduce_scatter and 2 (W - 1) / W for
            all_reduce (NCCL-tests' bus bandwidth: comparable across W and to the link speed)

Before timing, the results are checked once ("check: ok"): flat and 2DH all_to_all agree bit for bit and match
the numpy layout of Tutel's exchange ([E, C, M] -> [E / W, W * C, M], capacity source-major), both reverse
exchanges restore the input exactly, and all_gather / psum / psum_scatter match numpy (the reductions use
small-integer-valued data, so they are exact in every dtype for up to 256 devices).

On CPU, this script sets `--xla_force_host_platform_device_count` (one device per core, like
examples/helloworld.py) before JAX is imported unless XLA_FLAGS already sets it; fake CPU devices share the host's
memory bandwidth, so the CPU numbers measure XLA's collective implementation, not a network. Single process
(one host) only.

Differences from Tutel's script: a fixed number of timed calls (`--loop`, `--warmup`) instead of an endless loop,
`--dtype` (Tutel: float32), the other collectives and the 2DH exchange, a summary table and `--json`; the default
`--size_mb` is 16 (Tutel: 256) so that a bare run takes seconds on a CPU.

Example::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/bandwidth_test.py --size_mb 32 --loop 20
"""

from __future__ import annotations

import argparse
import os
import json
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tutel_jax.parallel import shard_map
from tutel_jax.cli_args import ensure_host_device_count, int_at_least, positive_float

from tutel_jax.parallel import expert_all_to_all, expert_all_to_all_reverse

ensure_host_device_count()  # one CPU device per core unless XLA_FLAGS sets a count; before any device use


DTYPES = ("float32", "bfloat16", "float16", "float64")
OPS = ("all_to_all", "all_to_all_2dh", "all_gather", "all_reduce", "reduce_scatter")
MIB = 1 << 20
AXIS = "world"               # the 1-D mesh
AXES_2DH = ("node", "local")  # the 2-D mesh: (W / L, L), node-major


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The argument parser (Tutel's --size_mb, plus --loop, --warmup, --devices, --node_size, --dtype, --json)."""
    parser = argparse.ArgumentParser(
        prog="bandwidth_test.py",
        description="Time all_to_all (flat and 2DH), all_gather, all_reduce and reduce_scatter over local devices.")
    parser.add_argument("--size_mb", type=positive_float, default=16.0,
                        help="buffer size per device in MB = 2**20 bytes (default 16; Tutel's default is 256)")
    parser.add_argument("--loop", type=int_at_least(1), default=10, help="timed calls per op (default 10)")
    parser.add_argument("--warmup", type=int_at_least(0), default=2,
                        help="untimed calls per op before timing, after the compile and check (default 2)")
    parser.add_argument("--devices", type=int_at_least(1), default=None,
                        help="use the first N devices (default: all)")
    parser.add_argument("--node_size", type=int_at_least(1), default=None,
                        help="devices per node L of the 2DH (node, local) mesh; must divide the device count "
                             "(default: the local device count when several processes run, else the smallest "
                             "divisor of the device count that is >= its square root)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--json", type=str, default="", metavar="PATH", help="also write the results as JSON")
    return parser


def default_node_size(num_devices: int) -> int:
    """Devices per node for the 2DH mesh: one host's devices when several processes run, else the smallest
    divisor of `num_devices` that is >= sqrt(num_devices) (8 -> 4, 6 -> 3, 4 -> 2, 2 -> 2, prime p -> p)."""
    local = jax.local_device_count()
    if jax.process_count() > 1 and num_devices % local == 0:
        return local
    return next(d for d in range(1, num_devices + 1) if num_devices % d == 0 and d * d >= num_devices)


def buffer_shape(size_bytes: float, num_devices: int, itemsize: int) -> tuple[int, int, int]:
    """The per-device [E, C, M] all_to_all buffer: E = num_devices, M a power of two <= 1024, and C * M as large
    as fits in `size_bytes`. Raises ValueError when not even one element per expert fits."""
    elements = int(size_bytes) // itemsize
    num_experts = num_devices
    if elements < num_experts:
        raise ValueError(f"{size_bytes / MIB:g} MB holds {elements} element(s) of {itemsize} bytes, fewer than "
                         f"one per device ({num_devices})")
    dim = 1024
    while num_experts * dim > elements:
        dim //= 2
    return num_experts, elements // (num_experts * dim), dim


# ----------------------------------------------------------------------------------------------------------
# The collectives (per-device bodies, run under shard_map)
# ----------------------------------------------------------------------------------------------------------
def a2a_flat(buf: jax.Array) -> jax.Array:
    """[E, C, M] -> [E / W, W * C, M]: the flat expert all_to_all over the 1-D mesh."""
    return expert_all_to_all(buf, AXIS, use_2dh=False)


def a2a_flat_reverse(buf: jax.Array) -> jax.Array:
    """[E / W, W * C, M] -> [E, C, M]."""
    return expert_all_to_all_reverse(buf, AXIS, use_2dh=False)


def a2a_2dh(buf: jax.Array) -> jax.Array:
    """[E, C, M] -> [E / W, W * C, M]: the 2DH expert all_to_all over the (node, local) mesh."""
    return expert_all_to_all(buf, AXES_2DH, use_2dh=True)


def a2a_2dh_reverse(buf: jax.Array) -> jax.Array:
    """[E / W, W * C, M] -> [E, C, M]."""
    return expert_all_to_all_reverse(buf, AXES_2DH, use_2dh=True)


def all_gather(buf: jax.Array) -> jax.Array:
    """[E / W, C, M] -> [E, C, M]."""
    return jax.lax.all_gather(buf, AXIS, axis=0, tiled=True)


def all_reduce(buf: jax.Array) -> jax.Array:
    """[E, C, M] -> [E, C, M], summed over devices."""
    return jax.lax.psum(buf, AXIS)


def reduce_scatter(buf: jax.Array) -> jax.Array:
    """[E, C, M] -> [E / W, C, M]: device d keeps the sum over devices of block d."""
    return jax.lax.psum_scatter(buf, AXIS, scatter_dimension=0, tiled=True)


def sharded(fn: Callable[[jax.Array], jax.Array], mesh: Mesh, spec: P) -> Callable[[jax.Array], jax.Array]:
    """jit(shard_map(fn)) with input and output split along axis 0 by `spec` (device-major global arrays)."""
    return jax.jit(shard_map(fn, mesh=mesh, in_specs=(spec,), out_specs=spec))


# ----------------------------------------------------------------------------------------------------------
# Buffers, checks and timing
# ----------------------------------------------------------------------------------------------------------
def make_buffer(key: jax.Array, global_shape: tuple[int, ...], dtype: Any, sharding: NamedSharding,
                integers: bool = False) -> jax.Array:
    """A random array created directly in its sharding from raw random bits (cheap even on a CPU): uniform
    in [-1, 1), or values in {-1, 0, 1} with `integers`."""
    def create(k: jax.Array) -> jax.Array:
        bits = jax.random.bits(k, global_shape, jnp.uint32)
        if integers:
            return (bits % 3).astype(dtype) - 1
        return ((bits >> 8).astype(jnp.float32) * 2.0 ** -23 - 1.0).astype(dtype)
    return jax.jit(create, out_shardings=sharding)(key)


def _host(x: Any) -> np.ndarray:
    """A device array on the host, in a numpy dtype wide enough for exact sums of small integers."""
    x = np.asarray(x)
    return x if x.dtype in (np.float32, np.float64) else x.astype(np.float32)


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(f"check failed: {what}")


def check(fns: dict[str, Callable], x: jax.Array, g: jax.Array, sh2: NamedSharding, key: jax.Array) -> None:
    """Runs every op once and compares with numpy; raises AssertionError on a mismatch.

    `x` is the [W * E, C, M] all_to_all buffer (device-major, random), `g` the [E, C, M] all_gather input
    (one row per device); the reductions run on a fresh {-1, 0, 1}-valued buffer shaped like `x`.
    """
    world = x.sharding.mesh.size
    num_experts, cap, dim = x.shape[0] // world, x.shape[1], x.shape[2]

    # all_to_all: flat == 2DH == numpy layout; reverse(forward(x)) == x for both.
    x_host = np.asarray(x)
    flat = fns["all_to_all"](x)
    hier = fns["all_to_all_2dh"](jax.device_put(x, sh2))
    n = num_experts // world
    expected = (x_host.reshape(world, world, n, cap, dim)          # [src, dst, n, C, M]
                .transpose(1, 2, 0, 3, 4)                          # [dst, n, src, C, M]
                .reshape(world * n, world * cap, dim))
    flat_host, hier_host = np.asarray(flat), np.asarray(hier)
    _require(flat_host.shape == expected.shape, f"all_to_all output shape {flat_host.shape} != {expected.shape}")
    _require(np.array_equal(flat_host, expected), "flat all_to_all differs from the numpy exchange")
    _require(np.array_equal(hier_host, flat_host), "2DH all_to_all differs from the flat all_to_all")
    _require(np.array_equal(np.asarray(fns["all_to_all_reverse"](flat)), x_host),
             "flat reverse all_to_all does not restore the input")
    _require(np.array_equal(np.asarray(fns["all_to_all_2dh_reverse"](hier)), x_host),
             "2DH reverse all_to_all does not restore the input")
    del flat, hier, flat_host, hier_host, expected, x_host

    _require(np.array_equal(np.asarray(fns["all_gather"](g)), np.tile(np.asarray(g), (world, 1, 1))),
             "all_gather differs from numpy")

    # Reductions on {-1, 0, 1}-valued data: every partial sum is a small integer, exact in every dtype (W <= 256).
    r = make_buffer(key, x.shape, x.dtype, x.sharding, integers=True)
    total = _host(r).reshape(world, num_experts, cap, dim).sum(axis=0)  # [E, C, M]
    _require(np.array_equal(_host(fns["all_reduce"](r)), np.tile(total, (world, 1, 1))), "psum differs from numpy")
    _require(np.array_equal(_host(fns["reduce_scatter"](r)), total),  # device d holds block d of the sum
             "psum_scatter differs from numpy")


def time_op(fn: Callable[[jax.Array], jax.Array], x: jax.Array, loop: int, warmup: int) -> list[float]:
    """Seconds per call of `fn(x)` (dispatch to block_until_ready), `loop` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        jax.block_until_ready(fn(x))
    times = []
    for _ in range(loop):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - t0)
    return times


def bus_factor(op: str, world: int) -> float:
    """NCCL-tests' bus bandwidth factor."""
    return (2.0 if op == "all_reduce" else 1.0) * (world - 1) / world


# ----------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> dict:
    """Runs the test; returns the results dict (also written to `--json`): run settings plus
    'results': {op: {'bytes', 'time_ms', 'times_ms', 'algbw_gbps', 'busbw_gbps', 'bus_factor'}} for the ops in OPS.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    dtype = jnp.dtype(args.dtype)

    available = jax.devices()
    if args.devices is not None and args.devices > len(available):
        parser.error(f"argument --devices: {args.devices} requested but only {len(available)} available")
    devices = available[:args.devices] if args.devices is not None else available
    world = len(devices)
    node_size = args.node_size if args.node_size is not None else default_node_size(world)
    if world % node_size:
        parser.error(f"argument --node_size: {node_size} does not divide the device count {world}")
    try:
        shape = buffer_shape(args.size_mb * MIB, world, dtype.itemsize)
    except ValueError as err:
        parser.error(f"argument --size_mb: {err}")
    num_experts, cap, dim = shape
    size_bytes = num_experts * cap * dim * dtype.itemsize

    mesh1 = Mesh(np.array(devices), (AXIS,))
    mesh2 = Mesh(np.array(devices).reshape(world // node_size, node_size), AXES_2DH)
    sh1, sh2 = NamedSharding(mesh1, P(AXIS)), NamedSharding(mesh2, P(AXES_2DH))
    fns = {
        "all_to_all": sharded(a2a_flat, mesh1, P(AXIS)),
        "all_to_all_reverse": sharded(a2a_flat_reverse, mesh1, P(AXIS)),
        "all_to_all_2dh": sharded(a2a_2dh, mesh2, P(AXES_2DH)),
        "all_to_all_2dh_reverse": sharded(a2a_2dh_reverse, mesh2, P(AXES_2DH)),
        "all_gather": sharded(all_gather, mesh1, P(AXIS)),
        "all_reduce": sharded(all_reduce, mesh1, P(AXIS)),
        "reduce_scatter": sharded(reduce_scatter, mesh1, P(AXIS)),
    }

    backend = jax.default_backend()
    print(f"[Bandwidth] jax {jax.__version__}, backend = {backend}, devices = {world} x "
          f"`{devices[0].device_kind}` (of {len(available)}), processes = {jax.process_count()}")
    print(f"[Bandwidth] dtype = {args.dtype}, buffer per device = [E, C, M] = {list(shape)} = "
          f"{size_bytes / MIB:g} MB (--size_mb {args.size_mb:g}), 2DH mesh (node, local) = "
          f"({world // node_size}, {node_size}), loop = {args.loop}, warmup = {args.warmup}", flush=True)

    # The buffers (random, created in place): x is [W * E, C, M] device-major, g is [E, C, M] (one row per device).
    k_x, k_g, k_check = jax.random.split(jax.random.key(0, impl="rbg"), 3)
    x1 = make_buffer(k_x, (world * num_experts, cap, dim), dtype, sh1)
    x2 = jax.device_put(x1, sh2)
    g = make_buffer(k_g, (num_experts, cap, dim), dtype, sh1)

    t0 = time.perf_counter()
    try:
        check(fns, x1, g, sh2, k_check)
    except AssertionError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    print(f"check: ok ({time.perf_counter() - t0:.2f} s, including compilation)", flush=True)

    inputs = {"all_to_all": x1, "all_to_all_2dh": x2, "all_gather": g, "all_reduce": x1, "reduce_scatter": x1}
    results: dict[str, dict] = {}
    print(f"\n{'op':<16}{'bytes/device':>14}{'time (ms)':>12}{'algbw (GB/s)':>14}{'busbw (GB/s)':>14}")
    for op in OPS:
        times = time_op(fns[op], inputs[op], args.loop, args.warmup)
        median = statistics.median(times)
        algbw = size_bytes / median * 1e-9
        factor = bus_factor(op, world)
        results[op] = {"bytes": size_bytes, "time_ms": median * 1e3, "times_ms": [t * 1e3 for t in times],
                       "algbw_gbps": algbw, "busbw_gbps": algbw * factor, "bus_factor": factor}
        print(f"{op:<16}{size_bytes:>14d}{median * 1e3:>12.3f}{algbw:>14.3f}{algbw * factor:>14.3f}", flush=True)
    print(f"\nAllToAll bandwidth across {world} device(s) = {results['all_to_all']['algbw_gbps']:.4f} GB/s "
          f"(2DH: {results['all_to_all_2dh']['algbw_gbps']:.4f} GB/s)")

    report = {
        "jax_version": jax.__version__, "backend": backend, "device_kind": devices[0].device_kind,
        "num_devices": world, "process_count": jax.process_count(), "node_size": node_size,
        "mesh_2dh": [world // node_size, node_size], "dtype": args.dtype, "size_mb": args.size_mb,
        "buffer_shape": list(shape), "bytes_per_device": size_bytes, "loop": args.loop, "warmup": args.warmup,
        "check": "ok", "results": results,
    }
    if args.json:
        path = os.path.abspath(args.json)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"Results written to `{path}`.")
    return report


if __name__ == "__main__":
    main()
