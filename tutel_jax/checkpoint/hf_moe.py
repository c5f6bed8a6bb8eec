"""One MoE block of a Hugging Face checkpoint as a tutel-jax layer: config + parameters.

Supported `model_type`s (float checkpoints; names as stored on disk):
  mixtral      block_sparse_moe.gate.weight, block_sparse_moe.experts.{e}.w1 / w3 [I, H] (gate / up), w2 [H, I]
  qwen3_moe    mlp.gate.weight, mlp.experts.{e}.{gate,up,down}_proj.weight
  qwen2_moe    as qwen3_moe, plus mlp.shared_expert.{gate,up,down}_proj.weight and mlp.shared_expert_gate.weight [1, H]
  deepseek_v3  mlp.gate.weight, mlp.gate.e_score_correction_bias, mlp.experts.{e}.*, mlp.shared_experts.*
               (also model_type kimi_k2; glm4_moe: the same names, dropped groups masked with -inf)
  gpt_oss      mlp.router.weight / bias, mlp.experts.gate_up_proj [E, H, 2I] (interleaved), gate_up_proj_bias,
               down_proj [E, I, H], down_proj_bias
The block maps hidden states [..., H] to the MoE output [..., H] exactly like the HF block (dropless: HF never
drops tokens), shared experts included. Read through `models.dequant.QuantizedTensors`, quantized expert weights
stay packed (experts `weight_format`, see `experts_quant`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from .. import quant_weights

__all__ = ["hf_moe_block", "hf_moe_block_tensors", "moe_layer_indices", "load_safetensors"]

SUPPORTED = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "glm4_moe", "gpt_oss")
#: model_types that are another family under a different name (Kimi-K2 ships DeepSeek-V3's architecture)
ALIASES = {"kimi_k2": "deepseek_v3"}


def family(config: Mapping) -> str | None:
    """The supported family of config.json's model_type (aliases resolved), or the model_type itself."""
    kind = config.get("model_type")
    return ALIASES.get(kind, kind)


def load_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a safetensors file as NumPy arrays (any dtype, bfloat16 and float8 included; every header
    entry validated before reading; see `safetensors_io`)."""
    from .safetensors_io import SafetensorsFile
    with SafetensorsFile(path) as f:
        return {name: f[name] for name in f.keys()}


def _num_experts(config: Mapping) -> int:
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if config.get(key):
            return int(config[key])
    raise ValueError("config has none of num_local_experts / num_experts / n_routed_experts")


def moe_layer_indices(config: Mapping) -> list[int]:
    """Indices of the decoder layers that hold an MoE block."""
    layers = int(config["num_hidden_layers"])
    kind = family(config)
    if kind in ("deepseek_v3", "glm4_moe"):
        first = int(config.get("first_k_dense_replace", 0))  # HF: every layer from first_k_dense_replace on
        return [i for i in range(layers) if i >= first]
    if kind in ("qwen3_moe", "qwen2_moe"):
        only_mlp = set(config.get("mlp_only_layers") or [])
        step = int(config.get("decoder_sparse_step", 1))
        return [i for i in range(layers) if i not in only_mlp and (i + 1) % step == 0]
    return list(range(layers))


def _take(tensors: Mapping[str, Any], key: str) -> Any:
    """The tensor `key` as a NumPy array, or as the quantized container a quantized view gives."""
    if key not in tensors:
        raise ValueError(f"checkpoint has no tensor {key!r}")
    value = tensors[key]
    return value if quant_weights.is_quantized(value) else np.asarray(value)


def _format_of(values: list, what: str) -> str | None:
    """The one weight format of `values` (None: all float); ValueError for a mix."""
    formats = {getattr(v, "format", None) for v in values}
    if len(formats) > 1:
        raise ValueError(f"{what}: mixed weight formats {sorted(map(str, formats))}")
    return formats.pop()


def _stack_swiglu(tensors, prefix: str, num_experts: int, names: tuple[str, str, str]) -> tuple[dict, str | None]:
    """Per-expert HF [out, in] weights -> ('swiglu' params, weight format). Float: gate_up_proj [E, M, 2, I],
    down_proj [E, I, M]; quantized: containers gate_proj / up_proj [E, I, M], down_proj [E, M, I]."""
    parts = {n: [_take(tensors, f"{prefix}{e}.{n}") for e in range(num_experts)] for n in names}
    fmt = _format_of([v for vs in parts.values() for v in vs], f"experts under {prefix!r}")
    if fmt is not None:
        return {key: quant_weights.stack(parts[n]) for key, n in zip(("gate_proj", "up_proj", "down_proj"),
                                                                     names)}, fmt
    gate, up, down = (np.stack(parts[n]) for n in names)  # [E, I, M], [E, I, M], [E, M, I]
    return {"gate_up_proj": np.stack([gate.transpose(0, 2, 1), up.transpose(0, 2, 1)], axis=2),
            "down_proj": down.transpose(0, 2, 1)}, None


def _shared_experts(tensors, prefix: str, hidden: int, gate_name: str | None = None) -> tuple[dict, dict]:
    """(the experts['shared'] spec, its params) from `{prefix}{gate,up,down}_proj.weight` (+ a sigmoid gate
    weight [1, H] under `gate_name`). Float weights take the [in, out] layout; quantized ones stay [out, in]."""
    params = {n: _take(tensors, f"{prefix}{n}.weight") for n in ("gate_proj", "up_proj", "down_proj")}
    fmt = _format_of(list(params.values()), prefix)
    if fmt is None:
        params = {n: v.T for n, v in params.items()}
    if gate_name is not None:
        params["gate"] = {"weight": _take(tensors, gate_name)}
    return {"hidden_size": hidden, "gate": gate_name is not None, "weight_format": fmt}, params


def hf_moe_block(tensors: Mapping[str, np.ndarray], config: Mapping, layer: int | None = None, *,
                 capacity_factor: float = 0.0, dtype: Any = "float32", place: Callable | None = None,
                 **config_kwargs: Any):
    """(MoEConfig, params) for the MoE block of decoder layer `layer` (default: the last MoE layer).

    Args:
      tensors: the checkpoint's tensors by on-disk name (e.g. `load_safetensors(path)`).
      config: the checkpoint's config.json as a dict.
      layer: decoder layer index; must hold an MoE block.
      capacity_factor: the gate's default (0: dropless, as in HF).
      dtype: the layer's dtype.
      place: `place(part, value, dtype) -> array` puts one checked tensor (part: 'gates', 'experts' or
        'shared_experts'; value: NumPy array or quantized container) on devices; default: the default device.
      config_kwargs: more `make_config` arguments (e.g. dropless_impl).
    """
    import jax.numpy as jnp

    from ..config import make_config

    kind = family(config)
    if kind not in SUPPORTED:
        raise ValueError(f"model_type must be one of {SUPPORTED} (or an alias: {sorted(ALIASES)}), "
                         f"got {config.get('model_type')!r}")
    moe_layers = moe_layer_indices(config)
    layer = moe_layers[-1] if layer is None else int(layer)
    if layer not in moe_layers:
        raise ValueError(f"layer {layer} has no MoE block (MoE layers: {moe_layers})")
    num_experts = _num_experts(config)
    k = int(config["num_experts_per_tok"])
    model_dim = int(config["hidden_size"])
    hidden = int(config.get("moe_intermediate_size") or config["intermediate_size"])
    experts: dict[str, Any] = {"count_per_node": num_experts, "hidden_size_per_expert": hidden}
    shared_params = None
    if kind == "mixtral":
        p = f"model.layers.{layer}.block_sparse_moe."
        gate = {"type": "mixtral", "k": k, "capacity_factor": capacity_factor}
        gate_params = {"weight": _take(tensors, p + "gate.weight")}
        experts["type"] = "swiglu"
        expert_params, experts["weight_format"] = _stack_swiglu(tensors, p + "experts.", num_experts,
                                                                ("w1.weight", "w3.weight", "w2.weight"))
    elif kind in ("qwen3_moe", "qwen2_moe", "deepseek_v3", "glm4_moe"):
        p = f"model.layers.{layer}.mlp."
        gate_params = {"weight": _take(tensors, p + "gate.weight")}
        experts["type"] = "swiglu"
        expert_params, experts["weight_format"] = _stack_swiglu(
            tensors, p + "experts.", num_experts, ("gate_proj.weight", "up_proj.weight", "down_proj.weight"))
        if kind in ("qwen3_moe", "qwen2_moe"):  # the same softmax top-k router
            gate = {"type": "qwen3_moe", "k": k, "capacity_factor": capacity_factor,
                    "norm_topk_prob": bool(config.get("norm_topk_prob", False))}
            if kind == "qwen2_moe" and config.get("shared_expert_intermediate_size"):
                experts["shared"], shared_params = _shared_experts(
                    tensors, p + "shared_expert.", int(config["shared_expert_intermediate_size"]),
                    p + "shared_expert_gate.weight")
        else:
            has_bias = p + "gate.e_score_correction_bias" in tensors
            gate = {"type": "deepseek_v3", "k": k, "capacity_factor": capacity_factor,
                    "n_group": int(config.get("n_group") or 1), "topk_group": int(config.get("topk_group") or 1),
                    "norm_topk_prob": bool(config.get("norm_topk_prob", True)),
                    "routed_scaling_factor": float(config.get("routed_scaling_factor", 1.0)),
                    "correction_bias": has_bias}
            if kind == "glm4_moe":  # HF's GLM-4 MoE router masks dropped groups with -inf (DeepSeek-V3: 0.0)
                gate["group_mask_value"] = float("-inf")
            if has_bias:
                gate_params["e_score_correction_bias"] = _take(tensors, p + "gate.e_score_correction_bias")
            n_shared = int(config.get("n_shared_experts") or 0)
            if n_shared:
                experts["shared"], shared_params = _shared_experts(tensors, p + "shared_experts.", hidden * n_shared)
    else:  # gpt_oss
        p = f"model.layers.{layer}.mlp."
        gate = {"type": "gpt_oss", "k": k, "capacity_factor": capacity_factor}
        gate_params = {"weight": _take(tensors, p + "router.weight"), "bias": _take(tensors, p + "router.bias")}
        experts.update(type="gpt_oss", swiglu_limit=float(config.get("swiglu_limit", 7.0)),
                       swiglu_alpha=float(config.get("swiglu_alpha", 1.702)))
        expert_params = {name: _take(tensors, p + "experts." + name)
                         for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}
        experts["weight_format"] = _format_of([expert_params["gate_up_proj"], expert_params["down_proj"]],
                                              p + "experts")
    moe_config = make_config(gate, model_dim, experts, dtype=dtype, **config_kwargs)
    raw = {"gates": [gate_params], "experts": expert_params}
    if shared_params is not None:
        raw["shared_experts"] = shared_params
    _check_against_template(moe_config, raw)  # before anything is put on a device
    fp32_gate = moe_config.gates[0].fp32_gate
    gate_dtype = lambda name: np.float32 if name == "e_score_correction_bias" or fp32_gate else moe_config.dtype
    place = place or (lambda part, value, dt: quant_weights.to_jax(value, dt))
    params = {"gates": [{n: place("gates", v, gate_dtype(n)) for n, v in gate_params.items()}],
              "experts": {n: place("experts", v, moe_config.dtype) for n, v in expert_params.items()}}
    if shared_params is not None:
        params["shared_experts"] = _tree_map(lambda v: place("shared_experts", v, moe_config.dtype),
                                                shared_params)
    return moe_config, params


def _check_against_template(moe_config, params) -> None:
    """The loaded tree must have exactly the layout and shapes `init_params` gives for this config."""
    from ..layer import init_params

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
    kind = family(config)
    if kind not in SUPPORTED:
        raise ValueError(f"model_type must be one of {SUPPORTED} (or an alias: {sorted(ALIASES)}), "
                         f"got {config.get('model_type')!r}")
    if any(quant_weights.is_quantized(v) for v in _leaves(params)):
        raise ValueError(f"layer {layer}: quantized expert weights cannot be exported (float checkpoints only)")
    arr = lambda a: np.asarray(a)
    gate, experts = params["gates"][0], params["experts"]
    out: dict[str, np.ndarray] = {}
    if kind == "gpt_oss":
        p = f"model.layers.{layer}.mlp."
        out[p + "router.weight"], out[p + "router.bias"] = arr(gate["weight"]), arr(gate["bias"])
        out.update({p + "experts." + n: arr(experts[n])
                    for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")})
        return out
    p = f"model.layers.{layer}." + ("block_sparse_moe." if kind == "mixtral" else "mlp.")
    out[p + "gate.weight"] = arr(gate["weight"])
    if "e_score_correction_bias" in gate:
        out[p + "gate.e_score_correction_bias"] = arr(gate["e_score_correction_bias"])
    names = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    gate_up, down = arr(experts["gate_up_proj"]), arr(experts["down_proj"])  # [E, M, 2, I], [E, I, M]
    for e in range(gate_up.shape[0]):
        for name, w in zip(names, (gate_up[e, :, 0].T, gate_up[e, :, 1].T, down[e].T)):
            out[f"{p}experts.{e}.{name}.weight"] = np.ascontiguousarray(w)
    shared = dict(params.get("shared_experts") or {})
    shared_prefix = p + ("shared_expert." if kind == "qwen2_moe" else "shared_experts.")
    if "gate" in shared:
        out[p + "shared_expert_gate.weight"] = arr(shared.pop("gate")["weight"])
    for name, w in shared.items():
        out[f"{shared_prefix}{name}.weight"] = np.ascontiguousarray(arr(w).T)
    return out


def _tree_map(fn, tree: Any) -> Any:
    """tree_map that keeps quantized containers whole."""
    return jax.tree_util.tree_map(fn, tree, is_leaf=quant_weights.is_quantized)


def _leaves(tree: Any) -> list:
    return jax.tree_util.tree_leaves(tree, is_leaf=quant_weights.is_quantized)
