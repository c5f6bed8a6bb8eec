"""Random float weights of an HF MoE decoder under its on-disk names and shapes, drawn as HF initialises a model
(`_init_weights`): every matrix (embedding, lm_head, linears, routers, experts) N(0, initializer_range), every
norm weight 1, every bias 0.

    tensors = random_hf_tensors(config, seed=0)        # {on-disk name: np.ndarray}
    params, moe_configs = hf_tables.load_params(tensors, config, spec_from_config(config))

Names and shapes come from the family tables (`hf_tables.attention_table` / `expected_shapes`, the family's
FFN prefix, router tensors, per-expert, fused (GPT-OSS) and shared-expert names), so every registered family is
covered, MLA (DeepSeek-V3) and attention sinks included. Dense layers (e.g. qwen3_moe's mlp_only_layers) get `{gate,up,down}_proj` of width intermediate_size;
tied embeddings (tie_word_embeddings) write no lm_head.

Deterministic per seed: one `np.random.default_rng(seed)` draws the matrices in `hf_tensor_shapes` order
(embedding, lm_head, then per layer: attention, the router tensors, the experts (0..E-1 each gate, up, down, or
the fused tensors), the shared experts), float32 `standard_normal * initializer_range`, then cast to `dtype`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from .families import family_of
from ._family import moe_hidden_size
from ._hf_tables import attention_table, expected_shapes, mlp_prefix
from ._moe_block import num_experts_of
from ._spec import spec_from_config

__all__ = ["hf_tensor_shapes", "random_hf_tensors"]

NORMAL, ONES, ZEROS = "normal", "ones", "zeros"


def _init_kind(name: str) -> str:
    """How HF initialises the tensor `name`: biases 0 (`.bias`, and GPT-OSS's fused `*_bias` / DeepSeek's
    `e_score_correction_bias`), norm weights 1, every other weight N(0, std)."""
    if name.endswith((".bias", "_bias")):
        return ZEROS
    return ONES if "norm" in name.rsplit(".", 2)[-2] else NORMAL


def _fused_expert_shapes(name: str, experts: int, hidden: int, inter: int) -> tuple[int, ...]:
    """GPT-OSS's fused expert tensors in HF's float layout: gate_up_proj [E, M, 2I] (+ bias [E, 2I]),
    down_proj [E, I, M] (+ bias [E, M])."""
    shapes = {"gate_up_proj": (experts, hidden, 2 * inter), "gate_up_proj_bias": (experts, 2 * inter),
              "down_proj": (experts, inter, hidden), "down_proj_bias": (experts, hidden)}
    if name not in shapes:
        raise ValueError(f"hf_tensor_shapes: unknown fused expert tensor {name!r} (known: {sorted(shapes)})")
    return shapes[name]


def hf_tensor_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """{on-disk name: shape ([out, in] for linears)} of every tensor of a float checkpoint of `config`
    (config.json as a dict), in the order `random_hf_tensors` draws them: embedding, lm_head, final norm, then
    per layer its attention (GQA or MLA, biases, sinks), norms, and its dense MLP or MoE block (router
    tensors, per-expert or fused experts, shared experts). Every registered family; for a quantized config the
    float (logical) layout, which `quant_layout.quantized_tensor_infos` turns into the packed one.

    Raises ValueError for an unknown model_type or a config missing a key.
    """
    family = family_of(config)  # ValueError for an unknown model_type
    try:
        spec = spec_from_config(config)
    except KeyError as e:
        raise ValueError(f"hf_tensor_shapes: config is missing key {e.args[0]!r}") from None
    shapes = expected_shapes(spec, config)
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": shapes["embed"]}
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = shapes["lm_head"]
    out["model.norm.weight"] = shapes["norm"]
    M, E, inter = spec.hidden_size, num_experts_of(config), moe_hidden_size(config)
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
        for ours, disk in family.router_tensor_names().items():
            out[ffn + disk] = (E, M) if ours == "weight" else (E,)
        if family.fused_experts is not None:
            out.update({f"{ffn}experts.{n}": _fused_expert_shapes(n, E, M, inter) for n in family.fused_experts})
        else:
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
    if config.get("quantization_config"):
        raise ValueError("random_hf_tensors: config has a quantization_config; only float checkpoints are drawn")
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
