"""Abstract weights: the parameter pytree `from_pretrained` would build, as `jax.ShapeDtypeStruct`s with
shardings, from config.json alone (no checkpoint file is read).

    model = abstract_model(config, mesh, dtype=jnp.bfloat16)
    model.params        # {'embed', 'layers': [...], 'norm'[, 'lm_head']}: ShapeDtypeStructs / quantized containers
    model.moe_configs   # per layer: the MoEConfig the loader makes (None: dense layer)

It follows the loader step by step without touching array data: the checkpoint's tensors by on-disk name,
dtype and shape (`quant_layout.checkpoint_layout`, packed formats included), the quantized view's containers
(`dequant.QuantizedTensors`), the in-memory layout (`param_layout.to_memory`: fused q/k/v),
the MoE block (`moe_block.hf_moe_block`: stacked experts, gate dtypes, shared experts) and the placement
(`placement.MeshPlacement`: routed experts split over the expert axis, the rest replicated). The real loader
cannot be run on abstract values: it fuses and stacks NumPy arrays, which for a real-size layer
means gigabytes on the host. `tests/compile/test_compile_cli.py` checks this tree against the real loader's, leaf by
leaf, for every family and quantized format.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


from .. import quant
from ..checkpoint import DTYPES
from ..layer import Execution, make_config
from ..models import (from_pretrained, moe_hidden_size, attention_table, mlp_prefix, num_experts_of, QuantizedTensors,
                      checkpoint_layout, hf_tensor_shapes, DecoderSpec, spec_from_config)
from ..models.families import family_of

__all__ = ["AbstractModel", "abstract_model", "abstract_tensors", "loader_moe_options", "per_device_bytes"]


def loader_moe_options() -> dict[str, Any]:
    """The MoE options `from_pretrained` passes to every MoE layer with its default arguments (so the programs
    compiled here are what a default load runs, kernel choice included)."""
    params = inspect.signature(from_pretrained).parameters
    return {"kernel_backend": params["kernel_backend"].default, "dropless_impl": params["dropless_impl"].default}


def abstract_tensors(config: Mapping[str, Any], quantized: bool = True) -> dict[str, Any]:
    """{on-disk name: abstract value} as the loader reads the checkpoint: float tensors as ShapeDtypeStructs of
    their stored dtype; with `quantized`, quantized weights (every format) as `pallas_kernels.quant`
    containers of their packed parts under the unquantized name (`dequant.QuantizedTensors`). Without it (or
    for FP8 blocks other than 128 x 128, which the loader dequantizes), the float32 tensors of
    `dequant.DequantizedTensors`."""
    q = config.get("quantization_config") or {}
    block = tuple(q.get("weight_block_size") or (128, 128))
    if not q or not quantized or (q.get("quant_method") == "fp8" and block != (128, 128)):
        code = "F32" if q else None
        layout = checkpoint_layout({k: v for k, v in config.items() if k != "quantization_config"})
        return {i.name: jax.ShapeDtypeStruct(i.shape, DTYPES[code or i.dtype]) for i, _ in layout}
    parts = {i.name: jax.ShapeDtypeStruct(i.shape, DTYPES[i.dtype]) for i, _ in checkpoint_layout(config)}
    return dict(QuantizedTensors(parts, config))  # the formats' containers of ShapeDtypeStructs


def _sds(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _attention(on_disk: dict[str, Any], spec: DecoderSpec) -> dict[str, Any]:
    """`param_layout.to_memory` on abstract values: float q/k/v fused."""
    out = dict(on_disk)
    qkv = [on_disk.get(f"{n}_proj") for n in "qkv"]
    if spec.mla is None and all(w is not None and not quant.is_quantized(w) for w in qkv):
        ws = [out.pop(f"{n}_proj") for n in "qkv"]
        out["qkv_proj"] = _sds((sum(w.shape[0] for w in ws), ws[0].shape[1]), ws[0].dtype)
        if "q_bias" in out:
            bs = [out.pop(f"{n}_bias") for n in "qkv"]
            out["qkv_bias"] = _sds((sum(b.shape[0] for b in bs),), bs[0].dtype)
    return out


def _format(values: list[Any]) -> str | None:
    formats = {getattr(v, "format", None) if quant.is_quantized(v) else None for v in values}
    if len(formats) > 1:
        raise ValueError(f"mixed weight formats {sorted(map(str, formats))}")
    return formats.pop()


def _stacked(w: Any, count: int) -> Any:
    """`quant.stack` of `count` experts like `w`: a leading axis on every field."""
    return jax.tree_util.tree_map(lambda a: _sds((count,) + tuple(a.shape), a.dtype), w)


def _moe_block(t: Mapping[str, Any], config: Mapping[str, Any], layer: int, dtype: str,
               moe_options: Mapping[str, Any]) -> tuple[Any, dict]:
    """`moe_block.hf_moe_block` on abstract tensors: (MoEConfig, {'gates', 'experts'[, 'shared_experts']}),
    leaves not yet cast or placed (see `_place`)."""
    family = family_of(config)
    E, M = num_experts_of(config), int(config["hidden_size"])
    p = f"model.layers.{layer}.{family.ffn_prefix}"
    names = dict(family.router_tensors)
    names.update({n: d for n, d in family.optional_router_tensors.items() if p + d in t})
    gate_params = {n: t[p + d] for n, d in names.items()}
    gate = {**family.router(config, frozenset(gate_params)), "k": int(config["num_experts_per_tok"]),
            "capacity_factor": 0.0}
    experts: dict[str, Any] = {"count_per_node": E, "hidden_size_per_expert": moe_hidden_size(config),
                               **family.experts(config)}
    if family.fused_experts is None:
        g, u, d = (t[f"{p}experts.0.{n}.weight"] for n in family.expert_names)
        experts["weight_format"] = _format([g, u, d])
        expert_params = {k: _stacked(w, E) for k, w in zip(("gate_proj", "up_proj", "down_proj"), (g, u, d))}
    else:  # float weights stored [E, in, out] become [E, out, in] (`hf_moe_block`)
        expert_params = {n: t[p + "experts." + n] for n in family.fused_experts}
        experts["weight_format"] = _format([v for n, v in expert_params.items() if not n.endswith("_bias")])
        if experts["weight_format"] is None:
            expert_params.update({n: _sds((v.shape[0], v.shape[2], v.shape[1]), v.dtype)
                                  for n, v in expert_params.items() if not n.endswith("_bias")})
    raw: dict[str, Any] = {"gates": [gate_params], "experts": expert_params}
    shared = family.shared_experts(config)
    if shared is not None:
        sp = {n: t[f"{p}{shared.prefix}{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj")}
        fmt = _format(list(sp.values()))
        if shared.gate is not None:
            sp["gate"] = {"weight": t[p + shared.gate]}
        experts["shared"] = {"hidden_size": shared.hidden_size, "gate": shared.gate is not None, "weight_format": fmt}
        raw["shared_experts"] = sp
    return make_config(gate, M, experts, dtype=dtype, **moe_options), raw


@dataclasses.dataclass(frozen=True)
class AbstractModel:
    """What `from_pretrained(path, dtype, mesh=mesh)` holds, abstract: `params` (ShapeDtypeStructs with
    shardings; quantized weights as containers of them), `moe_configs`, `spec`, the `mesh` and its
    `expert_axis`, and whether the dense weights are sharded (`shard_dense`) rather than replicated."""

    spec: DecoderSpec
    params: dict
    moe_configs: tuple
    mesh: Mesh
    expert_axis: str
    dtype: Any
    shard_dense: bool


def _dense_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """A dense weight split over every device along its largest dimension the device count divides (FSDP-like,
    used only when replicated dense weights do not fit); replicated if none does."""
    n, axes = math.prod(mesh.shape.values()), tuple(mesh.axis_names)
    dims = sorted((d for d in range(len(shape)) if shape[d] % n == 0 and shape[d] >= n), key=lambda d: -shape[d])
    if len(shape) < 2 or not dims:
        return NamedSharding(mesh, P())
    spec = [None] * len(shape)
    spec[dims[0]] = axes
    return NamedSharding(mesh, P(*spec))


def _place(part: str, value: Any, dtype: Any, mesh: Mesh, expert_axis: str, shard_dense: bool) -> Any:
    """`placement.MeshPlacement` on abstract values: floats cast to `dtype` (containers keep their packed
    dtypes); 'experts' split on their leading axis over `expert_axis`, the rest replicated (or, with
    `shard_dense`, the non-MoE weights split by `_dense_sharding`)."""
    def one(a):
        dt = a.dtype if quant.is_quantized(value) or not jnp.issubdtype(a.dtype, jnp.floating) else dtype
        if part == "experts":
            if a.shape[0] % mesh.shape[expert_axis]:
                raise ValueError(f"{a.shape[0]} experts cannot be split over mesh axis {expert_axis!r} of size "
                                 f"{mesh.shape[expert_axis]}")
            sharding = NamedSharding(mesh, P(expert_axis))
        elif part == "dense" and shard_dense:
            sharding = _dense_sharding(mesh, a.shape)
        else:
            sharding = NamedSharding(mesh, P())
        return jax.ShapeDtypeStruct(a.shape, dt, sharding=sharding)
    return jax.tree_util.tree_map(one, value)


def abstract_model(config: Mapping[str, Any], mesh: Mesh, expert_axis: str = "expert", dtype: Any = jnp.bfloat16,
                   quantized: bool = True, shard_dense: bool = False,
                   execution: Execution | None = None) -> AbstractModel:
    """The abstract `from_pretrained(..., dtype, mesh=mesh, expert_axis=expert_axis)` of `config` (see the
    module docstring). quantized=False: the weights of a quantized checkpoint as the loader's dequantized
    float view (`from_pretrained(dequantize=True)`), e.g. to train them. `execution`: its dropless_impl,
    dense_impl and attention_impl, where set, as `from_pretrained`'s arguments of those names. ValueError for a
    config the loader would reject (the message names the key)."""
    try:
        spec = spec_from_config(config)
        hf_tensor_shapes(config)  # every key the layout needs
    except KeyError as e:
        raise ValueError(f"config is missing key {e.args[0]!r}") from None
    t = abstract_tensors(config, quantized)
    dt_name = jnp.dtype(dtype).name
    place = lambda part, v, d: _place(part, v, d, mesh, expert_axis, shard_dense)
    options = loader_moe_options()
    knobs = (execution or Execution()).set_fields()
    if "dropless_impl" in knobs:
        options["dropless_impl"] = knobs["dropless_impl"]
    spec = dataclasses.replace(spec, **{k: v for k, v in knobs.items() if k in ("dense_impl", "attention_impl")})
    layers, moe_configs = [], []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        attn = _attention({k: t[p + "self_attn." + v] for k, v in attention_table(spec).items()}, spec)
        layer = {"attn": {k: place("dense", v, dtype) for k, v in attn.items()},
                 "input_layernorm": place("dense", t[p + "input_layernorm.weight"], dtype),
                 "post_attention_layernorm": place("dense", t[p + "post_attention_layernorm.weight"], dtype)}
        if spec.ffn[i] == "moe":
            moe_config, raw = _moe_block(t, config, i, dt_name, options)
            fp32_gate = moe_config.gates[0].fp32_gate
            gdt = lambda n: np.float32 if n == "e_score_correction_bias" or fp32_gate else moe_config.dtype
            layer["moe"] = {"gates": [{n: place("gates", v, gdt(n)) for n, v in raw["gates"][0].items()}],
                            "experts": {n: place("experts", v, moe_config.dtype) for n, v in raw["experts"].items()}}
            if "shared_experts" in raw:
                layer["moe"]["shared_experts"] = jax.tree_util.tree_map(
                    lambda v: place("shared_experts", v, moe_config.dtype), raw["shared_experts"],
                    is_leaf=quant.is_quantized)
            moe_configs.append(moe_config)
        else:
            mp = p + mlp_prefix(spec)
            layer["mlp"] = {k: place("dense", t[f"{mp}{k}.weight"], dtype)
                            for k in ("gate_proj", "up_proj", "down_proj")}
            moe_configs.append(None)
        layers.append(layer)
    params = {"embed": place("dense", t["model.embed_tokens.weight"], dtype), "layers": layers,
              "norm": place("dense", t["model.norm.weight"], dtype)}
    if not spec.tie_word_embeddings:
        params["lm_head"] = place("dense", t["lm_head.weight"], dtype)
    return AbstractModel(spec, params, tuple(moe_configs), mesh, expert_axis, dtype, shard_dense)


def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a pytree of sharded ShapeDtypeStructs (the largest shard of each leaf)."""
    total = 0
    for a in jax.tree_util.tree_leaves(tree):
        shape = a.sharding.shard_shape(a.shape) if getattr(a, "sharding", None) is not None else a.shape
        total += math.prod(shape) * jnp.dtype(a.dtype).itemsize
    return int(total)
