"""Random float weights of an HF MoE decoder under its on-disk names and shapes, drawn as HF initialises a model
(`_init_weights`): every matrix (embedding, lm_head, linears, routers, experts) N(0, initializer_range), every
norm weight 1, every bias 0.

    tensors = random_hf_tensors(config, seed=0)        # {on-disk name: np.ndarray}
    params, moe_configs = hf_tables.load_params(tensors, config, spec_from_config(config))

Names and shapes come from the family tables (`hf_tables.attention_table` / `expected_shapes`, the family's
FFN prefix, router, per-expert and shared-expert names), so every family whose MoE block is one router weight
[E, M] plus per-expert SwiGLU experts (and optionally shared experts) is covered: qwen3_moe, qwen2_moe, olmoe,
mixtral. Dense layers (e.g. qwen3_moe's mlp_only_layers) get `{gate,up,down}_proj` of width intermediate_size;
tied embeddings (tie_word_embeddings) write no lm_head.

Deterministic per seed: one `np.random.default_rng(seed)` draws the matrices in `hf_tensor_shapes` order
(embedding, lm_head, then per layer: attention q, k, v, o, the router, experts 0..E-1 each gate, up, down, the
shared experts), float32 `standard_normal * initializer_range`, then cast to `dtype`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from .families import family_of
from .family import moe_hidden_size
from .hf_tables import attention_table, expected_shapes, mlp_prefix
from .moe_block import _num_experts
from .spec import spec_from_config

__all__ = ["hf_tensor_shapes", "random_hf_tensors"]

NORMAL, ONES, ZEROS = "normal", "ones", "zeros"


def _init_kind(name: str) -> str:
    """How HF initialises the tensor `name`: biases 0, norm weights 1, every other weight N(0, std)."""
    if name.endswith(".bias"):
        return ZEROS
    return ONES if "norm" in name.rsplit(".", 2)[-2] else NORMAL


def _check_supported(config: Mapping[str, Any]) -> None:
    family = family_of(config)  # ValueError for an unknown model_type
    if config.get("quantization_config"):
        raise ValueError("random_hf_tensors: config has a quantization_config; only float checkpoints are drawn")
    why = []
    if family.mla is not None:
        why.append("multi-head latent attention")
    if family.sinks:
        why.append("attention sinks")
    if family.fused_experts is not None:
        why.append("fused expert tensors")
    if set(family.router_tensors) != {"weight"} or family.optional_router_tensors:
        why.append(f"router tensors {sorted(family.router_tensor_names())} (only one router weight is drawn)")
    if why:
        raise ValueError(f"random_hf_tensors: model_type {config.get('model_type')!r} is not supported ("
                         f"{', '.join(why)}); supported: families with one router weight [E, M] and per-expert "
                         "SwiGLU experts (qwen3_moe, qwen2_moe, olmoe, mixtral)")


def hf_tensor_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """{on-disk name: shape ([out, in] for linears)} of every tensor of a float checkpoint of `config`
    (config.json as a dict), in the order `random_hf_tensors` draws them.

    Raises ValueError for an unknown or unsupported model_type (see the module docstring) or a quantized config.
    """
    _check_supported(config)
    try:
        spec = spec_from_config(config)
    except KeyError as e:
        raise ValueError(f"random_hf_tensors: config is missing key {e.args[0]!r}") from None
    family = family_of(config)
    shapes = expected_shapes(spec, config)
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": shapes["embed"]}
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = shapes["lm_head"]
    out["model.norm.weight"] = shapes["norm"]
    M, E, inter = spec.hidden_size, _num_experts(config), moe_hidden_size(config)
    shared = family.shared_experts(config)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        out.update({f"{p}self_attn.{disk}": shapes[f"attn.{ours}"] for ours, disk in attention_table(spec).items()})
        out[p + "input_layernorm.weight"] = shapes["input_layernorm"]
        out[p + "post_attention_layernorm.weight"] = shapes["post_attention_layernorm"]
        ffn = p + mlp_prefix(spec)
        if spec.ffn[i] == "dense":
            out.update({f"{ffn}{k}.weight": shapes[f"mlp.{k}"] for k in ("gate_proj", "up_proj", "down_proj")})
            continue
        out[ffn + family.router_tensors["weight"]] = (E, M)
        gate, up, down = family.expert_names
        for e in range(E):
            x = f"{ffn}experts.{e}."
            out.update({f"{x}{gate}.weight": (inter, M), f"{x}{up}.weight": (inter, M),
                        f"{x}{down}.weight": (M, inter)})
        if shared is not None:
            s = ffn + shared.prefix
            out.update({f"{s}gate_proj.weight": (shared.hidden_size, M), f"{s}up_proj.weight": (shared.hidden_size, M),
                        f"{s}down_proj.weight": (M, shared.hidden_size)})
            if shared.gate is not None:
                out[ffn + shared.gate] = (1, M)
    return out


def random_hf_tensors(config: Mapping[str, Any], seed: int = 0, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """Random weights {on-disk name: array of `dtype`} of a float HF checkpoint of `config` (config.json as a
    dict; see the module docstring for the families, the init and the draw order).

    Args:
      config: e.g. a qwen3_moe config.json; `initializer_range` (default 0.02) is the matrices' std.
      seed: the NumPy Generator seed; the same config and seed give the same arrays.
      dtype: a floating NumPy dtype (float32, float16, ml_dtypes.bfloat16, ...); values are drawn in float32.
    Raises:
      ValueError naming the argument: unsupported model_type, quantized config, a non-float dtype, an
      initializer_range that is not a positive finite number.
    """
    if not jnp.issubdtype(np.dtype(dtype), jnp.floating):
        raise ValueError(f"random_hf_tensors: dtype must be a floating dtype, got {np.dtype(dtype)}")
    std = config.get("initializer_range", 0.02)
    if isinstance(std, bool) or not isinstance(std, (int, float)) or not (math.isfinite(std) and std > 0):
        raise ValueError(f"random_hf_tensors: config initializer_range must be a positive number, got {std!r}")
    shapes = hf_tensor_shapes(config)
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes.items():
        kind = _init_kind(name)
        if kind == NORMAL:
            a = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        else:
            a = (np.ones if kind == ONES else np.zeros)(shape, np.float32)
        out[name] = a.astype(dtype)
    return out
