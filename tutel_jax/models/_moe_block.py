"""One MoE block of a Hugging Face checkpoint as a tutel-jax layer: config + parameters, and back.

The family (`models.families`, by config.json's model_type) says where the block's tensors are and what they
mean: the FFN prefix under `model.layers.{i}.`, the router's tensors and gate type, the experts' layout
(per-expert SwiGLU `experts.{e}.<gate|up|down>.weight`, stacked here, or fused tensors taken as stored) and
the shared experts. The block maps hidden states [..., H] to the MoE output [..., H] exactly like the HF block
(dropless: HF never drops tokens), shared experts included. Read through `models.dequant.QuantizedTensors`,
quantized expert weights stay packed (experts `weight_format`: `SwiGLUExperts` / `GptOssExperts` hold the
containers, run through `grouped_linear`).

Public through `tutel_jax.models` (`hf_moe_block`, `hf_moe_block_tensors`, `moe_layer_indices`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from .. import quant
from ..layer import make_config, init_params
from .families import family_of
from ._family import moe_hidden_size

__all__ = ["hf_moe_block", "hf_moe_block_tensors", "moe_layer_indices"]


def num_experts_of(config: Mapping) -> int:
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if config.get(key):
            return int(config[key])
    raise ValueError("config has none of num_local_experts / num_experts / n_routed_experts")


def moe_layer_indices(config: Mapping) -> list[int]:
    """Indices of the decoder layers that hold an MoE block (ValueError for an unknown model_type)."""
    return list(family_of(config).moe_layers(config))


def _take(tensors: Mapping[str, Any], key: str) -> Any:
    """The tensor `key` as a NumPy array, or as the quantized container a quantized view gives."""
    if key not in tensors:
        raise ValueError(f"checkpoint has no tensor {key!r}")
    value = tensors[key]
    return value if quant.is_quantized(value) else np.asarray(value)


def _format_of(values: list, what: str) -> str | None:
    """The one weight format of `values` (None: all float); ValueError for a mix."""
    formats = {getattr(v, "format", None) for v in values}
    if len(formats) > 1:
        raise ValueError(f"{what}: mixed weight formats {sorted(map(str, formats))}")
    return formats.pop()


def _stack_swiglu(tensors, prefix: str, num_experts: int, names: tuple[str, str, str]) -> tuple[dict, str | None]:
    """Per-expert HF [out, in] weights -> ('swiglu' params, weight format): gate_proj / up_proj [E, I, M] and
    down_proj [E, M, I], float arrays or packed containers alike. Experts are read one at a time into the stacked
    arrays (a layer's experts are never held twice)."""
    params = {key: quant.stack((_take(tensors, f"{prefix}{e}.{n}") for e in range(num_experts)), num_experts,
                               what=f"{prefix}*.{n}")
              for key, n in zip(("gate_proj", "up_proj", "down_proj"), names)}
    return params, _format_of(list(params.values()), prefix + "*")


def _fused_experts(tensors, prefix: str, names: tuple[str, ...]) -> tuple[dict, str | None]:
    """Fused expert tensors (all experts in one) -> (params, weight format). A float weight is stored [E, in, out]
    and becomes [E, out, in] here, one expert at a time; a packed one is [E, out, in] already; biases as stored."""
    params = {}
    for name in names:
        value = _take(tensors, prefix + name)
        if not name.endswith("_bias") and not quant.is_quantized(value):
            if value.ndim != 3:
                raise ValueError(f"{prefix}{name}: expected [E, in, out], got shape {list(value.shape)}")
            value = quant.stack((value[e].T for e in range(value.shape[0])), value.shape[0], what=prefix + name)
        params[name] = value
    return params, _format_of([v for n, v in params.items() if not n.endswith("_bias")], prefix)


def _shared_experts(tensors, prefix: str, hidden: int, gate_name: str | None = None) -> tuple[dict, dict]:
    """(the experts['shared'] spec, its params) from `{prefix}{gate,up,down}_proj.weight` (+ a sigmoid gate
    weight [1, H] under `gate_name`), [out, in] as stored, float or quantized."""
    params = {n: _take(tensors, f"{prefix}{n}.weight") for n in ("gate_proj", "up_proj", "down_proj")}
    fmt = _format_of(list(params.values()), prefix)
    if gate_name is not None:
        params["gate"] = {"weight": _take(tensors, gate_name)}
    return {"hidden_size": hidden, "gate": gate_name is not None, "weight_format": fmt}, params


def hf_moe_block(tensors: Mapping[str, np.ndarray], config: Mapping, layer: int | None = None, *,
                 capacity_factor: float = 0.0, dtype: Any = "float32", place: Callable | None = None,
                 **config_kwargs: Any):
    """(MoEConfig, params) for the MoE block of decoder layer `layer` (default: the last MoE layer).

    Args:
      tensors: the checkpoint's tensors by on-disk name (e.g. `checkpoint.safetensors_io.load_safetensors(path)`).
      config: the checkpoint's config.json as a dict.
      layer: decoder layer index; must hold an MoE block.
      capacity_factor: the gate's default (0: dropless, as in HF).
      dtype: the layer's dtype.
      place: `place(part, value, dtype) -> array` puts one checked tensor (part: 'gates', 'experts' or
        'shared_experts'; value: NumPy array or quantized container) on devices; default: the default device.
      config_kwargs: more `make_config` arguments (e.g. dropless_impl).
    """

    family = family_of(config)
    moe_layers = moe_layer_indices(config)
    layer = moe_layers[-1] if layer is None else int(layer)
    if layer not in moe_layers:
        raise ValueError(f"layer {layer} has no MoE block (MoE layers: {moe_layers})")
    num_experts = num_experts_of(config)
    p = f"model.layers.{layer}.{family.ffn_prefix}"
    names = dict(family.router_tensors)
    names.update({n: d for n, d in family.optional_router_tensors.items() if p + d in tensors})
    gate_params = {n: _take(tensors, p + d) for n, d in names.items()}
    gate = {**family.router(config, frozenset(gate_params)), "k": int(config["num_experts_per_tok"]),
            "capacity_factor": capacity_factor}
    experts: dict[str, Any] = {"count_per_node": num_experts, "hidden_size_per_expert": moe_hidden_size(config),
                               **family.experts(config)}
    if family.fused_experts is None:
        expert_params, experts["weight_format"] = _stack_swiglu(
            tensors, p + "experts.", num_experts, tuple(f"{n}.weight" for n in family.expert_names))
    else:
        expert_params, experts["weight_format"] = _fused_experts(tensors, p + "experts.", family.fused_experts)
    shared, shared_params = family.shared_experts(config), None
    if shared is not None:
        experts["shared"], shared_params = _shared_experts(tensors, p + shared.prefix, shared.hidden_size,
                                                           None if shared.gate is None else p + shared.gate)
    moe_config = make_config(gate, int(config["hidden_size"]), experts, dtype=dtype, **config_kwargs)
    raw = {"gates": [gate_params], "experts": expert_params}
    if shared_params is not None:
        raw["shared_experts"] = shared_params
    _check_against_template(moe_config, raw)  # before anything is put on a device
    fp32_gate = moe_config.gates[0].fp32_gate
    gate_dtype = lambda name: np.float32 if name == "e_score_correction_bias" or fp32_gate else moe_config.dtype
    place = place or (lambda part, value, dt: quant.to_jax(value, dt))
    params = {"gates": [{n: place("gates", v, gate_dtype(n)) for n, v in gate_params.items()}],
              "experts": {n: place("experts", v, moe_config.dtype) for n, v in expert_params.items()}}
    if shared_params is not None:
        params["shared_experts"] = _tree_map(lambda v: place("shared_experts", v, moe_config.dtype),
                                             shared_params)
    return moe_config, params


def _check_against_template(moe_config, params) -> None:
    """The loaded tree must have exactly the layout and shapes `init_params` gives for this config."""

    template = jax.eval_shape(lambda: init_params(moe_config, jax.random.key(0)))
    got = jax.tree_util.tree_flatten_with_path(params)[0]
    want = jax.tree_util.tree_flatten_with_path(template)[0]
    if [p for p, _ in got] != [p for p, _ in want]:
        raise ValueError(f"loaded parameters {[jax.tree_util.keystr(p) for p, _ in got]} do not match the layer's "
                         f"{[jax.tree_util.keystr(p) for p, _ in want]}")
    for (path, a), (_, b) in zip(got, want):
        if tuple(a.shape) != tuple(b.shape):
            raise ValueError(f"tensor {jax.tree_util.keystr(path)} has shape {tuple(a.shape)}, the layer expects "
                             f"{tuple(b.shape)}")


def hf_moe_block_tensors(params: Mapping[str, Any], config: Mapping, layer: int) -> dict[str, np.ndarray]:
    """The inverse of `hf_moe_block` for float weights: the block's tensors under their on-disk names.

    params: the block's {'gates', 'experts'[, 'shared_experts']} as `hf_moe_block` builds them.
    Quantized expert weights: ValueError (export writes float checkpoints only).
    """
    family = family_of(config)
    if any(quant.is_quantized(v) for v in _leaves(params)):
        raise ValueError(f"layer {layer}: quantized expert weights cannot be exported (float checkpoints only)")
    arr = lambda a: np.asarray(a)
    gate, experts = params["gates"][0], params["experts"]
    p = f"model.layers.{layer}.{family.ffn_prefix}"
    router_names = family.router_tensor_names()
    unknown = sorted(set(gate) - set(router_names))
    if unknown:
        raise ValueError(f"layer {layer}: gate parameters {unknown} have no {family.name} checkpoint name")
    out: dict[str, np.ndarray] = {p + router_names[n]: arr(v) for n, v in gate.items()}
    if family.fused_experts is not None:  # weights back to the stored [E, in, out]
        out.update({p + "experts." + n: arr(experts[n]) if n.endswith("_bias")
                    else np.ascontiguousarray(np.swapaxes(arr(experts[n]), 1, 2)) for n in family.fused_experts})
    else:
        for key, name in zip(("gate_proj", "up_proj", "down_proj"), family.expert_names):
            w = arr(experts[key])
            out.update({f"{p}experts.{e}.{name}.weight": np.ascontiguousarray(w[e]) for e in range(w.shape[0])})
    shared_params = dict(params.get("shared_experts") or {})
    if shared_params:
        shared = family.shared_experts(config)
        if shared is None:
            raise ValueError(f"layer {layer}: shared experts, but the config of this {family.name} model has none")
        if "gate" in shared_params and shared.gate is not None:
            out[p + shared.gate] = arr(shared_params.pop("gate")["weight"])
        for name, w in shared_params.items():
            out[f"{p}{shared.prefix}{name}.weight"] = np.ascontiguousarray(arr(w))
    return out


def _tree_map(fn, tree: Any) -> Any:
    """tree_map that keeps quantized containers whole."""
    return jax.tree_util.tree_map(fn, tree, is_leaf=quant.is_quantized)


def _leaves(tree: Any) -> list:
    return jax.tree_util.tree_leaves(tree, is_leaf=quant.is_quantized)
