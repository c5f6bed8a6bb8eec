"""`compile_model`: choose a mesh for a target, build the model's programs over abstract weights, compile them
deviceless and add up what one device needs and how fast a step can be. The result is the JSON of
`tutel-jax compile --json` (see `cli.py` for its fields)."""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ..models.moe_block import _num_experts
from .programs import Step, build_steps
from .report import analyze
from .topology import Target, topology_of
from .weights import AbstractModel, abstract_model, per_device_bytes

__all__ = ["choose_mesh", "compile_model", "devices_to_fit"]


def choose_mesh(topo: Any, config: Mapping[str, Any]) -> tuple[Any, str]:
    """(mesh, description): the routed experts split over as many devices as divide their count (axis
    'expert', the loader's expert placement); the remaining factor of the devices, if any, is an axis
    'replica' over which everything is replicated."""
    from jax.experimental import topologies
    n = len(topo.devices)
    experts = _num_experts(config)
    w = math.gcd(experts, n)
    if w == n:
        mesh = topologies.make_mesh(topo, (n,), ("expert",))
    else:
        mesh = topologies.make_mesh(topo, (n // w, w), ("replica", "expert"))
    what = f"expert={w}" + (f" x replica={n // w}" if w != n else "")
    return mesh, f"{what}: {experts} routed experts split {experts // w} per device over 'expert'"


def _estimate(model: AbstractModel, batch: int, seq: int, mode: str) -> int:
    """Resident bytes per device before compiling: weights (+ the KV cache for serving, + two AdamW moments)."""
    w = per_device_bytes(model.params)
    if mode == "train":
        return 3 * w
    from ..models.attention import cache_dims
    heads, dk, dv = cache_dims(model.spec)
    return w + model.spec.num_layers * batch * heads * seq * (dk + dv) * jnp.dtype(model.dtype).itemsize


def devices_to_fit(model: AbstractModel, total: int, hbm: int) -> int | None:
    """The fewest devices (splitting the experts, replicating the rest) whose share of `total` fits `hbm`:
    total = fixed + expert_bytes / n; None if even the fixed part does not fit."""
    n = math.prod(model.mesh.shape.values())
    expert = sum(per_device_bytes(l["moe"]["experts"]) for l in model.params["layers"] if "moe" in l)
    fixed = total - expert
    if fixed >= hbm:
        return None
    return max(1, math.ceil(expert * model.mesh.shape[model.expert_axis] / (hbm - fixed))) if expert else n


#: XLA options of a compile without the devices: the GPU compiler would time candidate GEMM / fusion configs on
#: a device (autotuning) and ask the CUDA runtime for CUB radix sort's scratch size (large sorts, e.g. the
#: dropless token sort of a long prefill); without a device it takes its heuristics' choice and XLA's own sort
_DEVICELESS_OPTIONS = {"gpu": {"xla_gpu_autotune_level": 0, "xla_gpu_enable_cub_radix_sort": False}, "tpu": {}}


def _compile_step(step: Step, mesh: Any, platform: str, log) -> tuple[list[dict], float]:
    parts = []
    for part in step.parts:
        t0 = time.perf_counter()
        with jax.set_mesh(mesh):
            compiled = part.fn.lower(*part.args).compile(compiler_options=_DEVICELESS_OPTIONS[platform])
        seconds = time.perf_counter() - t0
        arg_bytes = Counter()
        for tag, arg in zip(part.tags, part.args):
            arg_bytes[tag] += per_device_bytes(arg)
        a = analyze(compiled, dict(arg_bytes), seconds)
        a.update(part=part.name, runs=part.count, layers=part.layers)
        log(f"  {step.name}: {part.name} x{part.count} compiled in {seconds:.1f} s")
        parts.append(a)
    return parts, sum(p["compile_seconds"] for p in parts)


def compile_model(config: Mapping[str, Any], target: Target, batch: int, seq: int, mode: str = "serve",
                  dtype: Any = jnp.bfloat16, log=lambda msg: None) -> dict:
    """The report of `config` on `target` (see `cli.py` for the JSON fields). ValueError for a config the
    loader rejects; DevicelessUnavailable without the target's compiler."""
    hw = target.hardware
    topo = topology_of(target)
    mesh, description = choose_mesh(topo, config)
    train = mode == "train"
    model = abstract_model(config, mesh, dtype=dtype, quantized=not train)
    if _estimate(model, batch, seq, mode) > hw.hbm_bytes and len(topo.devices) > 1:
        model = abstract_model(config, mesh, dtype=dtype, quantized=not train, shard_dense=True)
        description += "; dense weights split over all devices (replicated they do not fit)"
    else:
        description += "; dense weights (attention, norms, embedding, head, shared experts, gates) replicated"
    weights = per_device_bytes(model.params)
    programs = []
    for step in build_steps(model, batch, seq, mode):
        parts, compile_seconds = _compile_step(step, mesh, hw.platform, log)
        kv = per_device_bytes(step.kv_cache) if step.kv_cache is not None else 0
        opt = per_device_bytes(step.optimizer) if step.optimizer is not None else 0
        act = max(p["transient_bytes"] for p in parts)
        if train:  # each block's input is kept from the forward for its recomputed backward
            x = per_device_bytes(step.parts[1].args[2])
            act += x * sum(p["runs"] for p in parts[1:-1])
        total = weights + kv + opt + act
        flops = sum(p["flops"] * p["runs"] for p in parts)
        nbytes = sum(p["bytes"] * p["runs"] for p in parts)
        floor = max(flops / hw.peak_bf16_flops, nbytes / hw.hbm_bytes_per_s)
        tokens = batch if step.name == "decode" else batch * seq
        kernels, xla_kernels, collectives = Counter(), Counter(), Counter()
        for p in parts:
            kernels.update({k: v * p["runs"] for k, v in p["kernels"].items()})
            xla_kernels.update({k: v * p["runs"] for k, v in p["xla_kernels"].items()})
            collectives.update({k: v * p["runs"] for k, v in p["collectives"].items()})
        programs.append({
            "program": step.name,
            "bytes_per_device": {"weights": weights, "kv_cache": kv, "optimizer": opt,
                                 "activations_and_temps": act, "total": total},
            "fits": total <= hw.hbm_bytes,
            "devices_to_fit": None if total <= hw.hbm_bytes else devices_to_fit(model, total, hw.hbm_bytes),
            "weights_from_programs": sum(p["argument_bytes"].get("weights", 0) * p["runs"] for p in parts),
            "kernels": dict(sorted(kernels.items())),
            "xla_kernels": dict(sorted(xla_kernels.items())),
            "collectives": {k: collectives.get(k, 0) for k in parts[0]["collectives"]},
            "roofline": {"step_seconds_floor": floor,
                         "bound": "compute" if flops / hw.peak_bf16_flops >= nbytes / hw.hbm_bytes_per_s else "memory",
                         "flops": flops, "bytes": nbytes, "tokens": tokens,
                         "tokens_per_second_ceiling": tokens / floor if floor > 0 else float("inf"),
                         "cost_source": parts[0]["cost_source"]},
            "compile_seconds": round(compile_seconds, 2),
            "parts": parts,
        })
    return {
        "target": target.spelling, "platform": hw.platform, "device_kind": hw.device_kind,
        "devices": len(topo.devices), "hosts": len({d.process_index for d in topo.devices}),
        "hbm_bytes_per_device": hw.hbm_bytes,
        "hardware": {"hbm_bytes_per_s": hw.hbm_bytes_per_s, "peak_bf16_flops": hw.peak_bf16_flops,
                     "interconnect_bytes_per_s": hw.interconnect_bytes_per_s, "source": hw.source},
        "mesh": {"axes": dict(mesh.shape), "expert_axis": model.expert_axis, "dense_sharded": model.shard_dense,
                 "description": description},
        "model": {"model_type": model.spec.model_type, "layers": model.spec.num_layers,
                  "parameters": _parameters(model.params), "dtype": jnp.dtype(dtype).name,
                  "weights_trained_as_float": train and bool(config.get("quantization_config"))},
        "batch": batch, "seq": seq, "mode": mode,
        "derivation": ("per device; weights: every layer's weights as placed (the weight arguments of embed + each "
                       "block program x its blocks + head; 'weights_from_programs' adds them up, tied embeddings "
                       "twice); kv_cache: every layer's cache [B, Hkv, S, D]; optimizer: AdamW's two moments and "
                       "count; activations_and_temps: the largest program's XLA temp + unaliased outputs + "
                       "activation arguments" + (" + each block's saved input x blocks (train: blocks recompute "
                       "their forward)" if train else "") + "; roofline: sum over the programs of XLA's flops and "
                       "bytes accessed x their runs per step, floor = max(flops / peak bf16, bytes / HBM bandwidth)"),
        "programs": programs,
    }


def _parameters(params: Any) -> int:
    """Logical parameter count (a packed weight counts its unpacked values: [..., out, in] of its container)."""
    from .. import quant_weights
    leaves = jax.tree_util.tree_leaves(params, is_leaf=quant_weights.is_quantized)
    return int(sum(math.prod(quant_weights.logical_shape(w)) for w in leaves))
