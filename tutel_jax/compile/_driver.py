"""`compile_model`: choose a mesh for a target, build the model's programs over abstract weights, compile them
deviceless and add up what one device needs and how fast a step can be. The result is the JSON of
`tutel-jax compile --json` (see `_cli.py` for its fields)."""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import topologies

from .. import quant
from ..layer import Execution
from ..models import cache_dims, num_experts_of
from ._programs import Step, build_steps
from ._report import COLLECTIVES, analyze
from ._roofline import roofline
from ._topology import Target, topology_of
from ._weights import AbstractModel, abstract_model, per_device_bytes

__all__ = ["choose_mesh", "compile_model", "devices_to_fit"]


def choose_mesh(topo: Any, config: Mapping[str, Any]) -> tuple[Any, str]:
    """(mesh, description): the routed experts split over as many devices as divide their count (axis
    'expert', the loader's expert placement); the remaining factor of the devices, if any, is an axis
    'replica' over which everything is replicated."""
    n = len(topo.devices)
    experts = num_experts_of(config)
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


#: XLA:TPU refuses to compile a program whose buffers exceed the chip's HBM; the message states what it needed
_HBM_OOM = re.compile(r"memory required for HLO temporaries \(([\d.]+)([KMGT]?)\)")


def _oom_part(error: Exception, arg_bytes: dict[str, int], seconds: float) -> dict | None:
    """The analysis of a part the compiler refused for lack of HBM (XLA:TPU's CompileTimeHbmOom): its transient
    bytes are the temporaries the message states (XLA prints binary units) + its activation arguments; no cost,
    kernels or collectives (nothing compiled). None for any other error."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text and "HbmOom" not in text:
        return None
    m = _HBM_OOM.search(text)
    temps = int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2) or " ")) if m else None
    return {"xla_memory": None, "argument_bytes": arg_bytes,
            "transient_bytes": None if temps is None else temps + arg_bytes.get("activations", 0),
            "flops": 0.0, "bytes": 0.0, "cost_source": None, "kernels": {}, "xla_kernels": {},
            "collectives": dict.fromkeys(COLLECTIVES, 0), "compile_seconds": round(seconds, 2),
            "compile_error": text.strip().splitlines()[0][:400]}


def _compile_step(step: Step, mesh: Any, platform: str, log) -> tuple[list[dict], float]:
    """Compiles every part of `step` for the target and analyzes it (`report.analyze`); a part the compiler
    refuses for lack of HBM is recorded as such (`_oom_part`) and the step goes on."""
    parts = []
    for part in step.parts:
        arg_bytes = Counter()
        for tag, arg in zip(part.tags, part.args):
            arg_bytes[tag] += per_device_bytes(arg)
        t0 = time.perf_counter()
        try:
            with jax.set_mesh(mesh):
                compiled = part.fn.lower(*part.args).compile(compiler_options=_DEVICELESS_OPTIONS[platform])
        except Exception as e:  # XLA raises its runtime error type; only an HBM refusal is a result
            a = _oom_part(e, dict(arg_bytes), time.perf_counter() - t0)
            if a is None:
                raise
            a.update(part=part.name, runs=part.count, layers=part.layers)
            log(f"  {step.name}: {part.name} refused by the compiler: {a['compile_error'][:120]}")
            parts.append(a)
            continue
        seconds = time.perf_counter() - t0
        a = analyze(compiled, dict(arg_bytes), seconds)
        a.update(part=part.name, runs=part.count, layers=part.layers)
        log(f"  {step.name}: {part.name} x{part.count} compiled in {seconds:.1f} s")
        parts.append(a)
    return parts, sum(p["compile_seconds"] for p in parts)


#: how the report's `roofline` is computed (the JSON's `derivation`; `_roofline.py` has the full statement)
ROOFLINE_DERIVATION = (
    "roofline (analytic, per device, from the config and the weights' shapes; see tutel_jax/compile/_roofline.py): "
    "flops = 2 x tokens x the matrix parameters each token uses (attention, dense MLPs, routers, shared experts, "
    "min(k, E) routed experts) + 2 x H x (d_qk + d_v) per causal (query, key) pair within each layer's window + "
    "the LM head on the rows that get logits; bytes = every dense weight once + min(E, tokens x k) routed experts "
    "per MoE layer in their stored (packed) format + the KV cache slots read and written; training: 3x the "
    "forward's flops and weights, gradients, AdamW moments read and written; routed experts split over the "
    "expert axis (ceil(touched / w) experts per device), dense weights and KV cache whole per device unless "
    "split; floor = max(flops / peak bf16, bytes / HBM bandwidth). xla_cost: XLA's own cost analysis of the "
    "compiled programs, reference only")
#: what XLA's cost analysis misses, by the source of the numbers
_XLA_COST_NOTES = {
    "hlo-cost-analysis": ("the GPU compiler reports no cost; this is the host XLA's HLO cost analysis of the "
                          "compiled GPU module, which counts custom calls (the project's Pallas / Triton "
                          "kernels) as 0 flops and does not see what they read: an undercount wherever the kernels "
                          "run"),
    "xla": ("the compiler's cost analysis of the compiled program; XLA:TPU's 'bytes accessed' is no HBM floor "
            "(for one gpt-oss-20b decode step it reports about 4e13 bytes, thousands of times the weights)"),
}


def _xla_cost(parts: list[dict], hw: Any) -> dict:
    """XLA's own flops / bytes of a step (its parts' cost analysis x their runs) and the floor they would give:
    kept for reference beside the analytic roofline, with a note saying what they miss."""
    flops = sum(p["flops"] * p["runs"] for p in parts)
    nbytes = sum(p["bytes"] * p["runs"] for p in parts)
    source = next((p["cost_source"] for p in parts if p["cost_source"]), None)
    if source is None:
        return {"flops": None, "bytes": None, "step_seconds": None, "source": None,
                "note": "no part of the step compiled"}
    missing = [p["part"] for p in parts if p.get("compile_error")]
    return {"flops": flops, "bytes": nbytes,
            "step_seconds": max(flops / hw.peak_bf16_flops, nbytes / hw.hbm_bytes_per_s),
            "source": source, "note": _XLA_COST_NOTES[source] + (
                f"; parts the compiler refused are missing: {', '.join(missing)}" if missing else "")}


def compile_model(config: Mapping[str, Any], target: Target, batch: int, seq: int, mode: str = "serve",
                  dtype: Any = jnp.bfloat16, log=lambda msg: None, decode_batches: tuple[int, ...] = (),
                  execution: Execution | None = None) -> dict:
    """The report of `config` on `target` (see `_cli.py` for the JSON fields). `decode_batches`: serving also
    reports the analytic decode roofline at these batch sizes (same placement and seq; nothing compiled), as
    `decode_rooflines` {batch: roofline}. `execution`: the model's paths (`abstract_model`). ValueError for a
    config the loader rejects; DevicelessUnavailable without the target's compiler."""
    hw = target.hardware
    topo = topology_of(target)
    mesh, description = choose_mesh(topo, config)
    train = mode == "train"
    model = abstract_model(config, mesh, dtype=dtype, quantized=not train, execution=execution)
    if _estimate(model, batch, seq, mode) > hw.hbm_bytes and len(topo.devices) > 1:
        model = abstract_model(config, mesh, dtype=dtype, quantized=not train, shard_dense=True, execution=execution)
        description += "; dense weights split over all devices (replicated they do not fit)"
    else:
        description += "; dense weights (attention, norms, embedding, head, shared experts, gates) replicated"
    weights = per_device_bytes(model.params)
    programs = []
    for step in build_steps(model, batch, seq, mode):
        parts, compile_seconds = _compile_step(step, mesh, hw.platform, log)
        kv = per_device_bytes(step.kv_cache) if step.kv_cache is not None else 0
        opt = per_device_bytes(step.optimizer) if step.optimizer is not None else 0
        refused = [f"{p['part']}: {p['compile_error']}" for p in parts if p.get("compile_error")]
        act = max((p["transient_bytes"] for p in parts if p["transient_bytes"] is not None), default=0)
        if train:  # each block's input is kept from the forward for its recomputed backward
            x = per_device_bytes(step.parts[1].args[2])
            act += x * sum(p["runs"] for p in parts[1:-1])
        total = weights + kv + opt + act
        analytic = roofline(model, step.name, batch, seq, hw, optimizer_bytes=opt)
        kernels, xla_kernels, collectives = Counter(), Counter(), Counter()
        for p in parts:
            kernels.update({k: v * p["runs"] for k, v in p["kernels"].items()})
            xla_kernels.update({k: v * p["runs"] for k, v in p["xla_kernels"].items()})
            collectives.update({k: v * p["runs"] for k, v in p["collectives"].items()})
        programs.append({
            "program": step.name,
            "bytes_per_device": {"weights": weights, "kv_cache": kv, "optimizer": opt,
                                 "activations_and_temps": act, "total": total},
            "fits": total <= hw.hbm_bytes and not refused,
            "devices_to_fit": None if total <= hw.hbm_bytes and not refused else devices_to_fit(model, total, hw.hbm_bytes),
            "compile_errors": refused,
            "weights_from_programs": sum(p["argument_bytes"].get("weights", 0) * p["runs"] for p in parts),
            "kernels": dict(sorted(kernels.items())),
            "xla_kernels": dict(sorted(xla_kernels.items())),
            "collectives": {k: collectives.get(k, 0) for k in parts[0]["collectives"]},
            "roofline": analytic,
            "xla_cost": _xla_cost(parts, hw),
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
                       "their forward)" if train else "") + "; " + ROOFLINE_DERIVATION),
        "programs": programs,
        "decode_rooflines": {str(b): roofline(model, "decode", b, seq, hw) for b in decode_batches if not train},
    }


def _parameters(params: Any) -> int:
    """Logical parameter count (a packed weight counts its unpacked values: [..., out, in] of its container)."""
    leaves = jax.tree_util.tree_leaves(params, is_leaf=quant.is_quantized)
    return int(sum(math.prod(quant.logical_shape(w)) for w in leaves))
