"""DecoderSpec: the static shape of an HF MoE decoder, read from its config.json."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from ..checkpoint.hf_moe import ALIASES, family, moe_layer_indices
from .layers import rope_inv_freq

__all__ = ["FAMILIES", "MLASpec", "DecoderSpec", "spec_from_config"]

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "glm4_moe", "gpt_oss") + tuple(ALIASES)


@dataclasses.dataclass(frozen=True)
class MLASpec:
    """DeepSeek multi-head latent attention dims."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_dim: int
    rope_interleave: bool
    softmax_scale: float


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    """Static description of a pre-norm decoder: embed -> layers (x + attn(norm(x)); x + ffn(norm(x))) ->
    norm -> lm_head. `ffn[i]` is 'moe' or 'dense'; `windows[i]` the sliding window of layer i (None: full)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    inv_freq: tuple[float, ...]
    attention_factor: float
    windows: tuple[int | None, ...]
    ffn: tuple[str, ...]
    qk_norm: bool = False
    attention_bias: bool = False  # q/k/v/o biases (GPT-OSS)
    qkv_bias: bool = False  # q/k/v biases only (Qwen2-MoE, GLM-4 MoE)
    rotary_dim: int | None = None  # RoPE on the first rotary_dim dims of each head (GLM-4 MoE); None: all
    sinks: bool = False
    tie_word_embeddings: bool = False
    mla: MLASpec | None = None

    @property
    def last_moe_layer(self) -> int | None:
        moe = [i for i, f in enumerate(self.ffn) if f == "moe"]
        return moe[-1] if moe else None


def _rope_params(config: Mapping[str, Any]) -> dict:
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return rope


def _windows(config: Mapping[str, Any], n: int) -> tuple[int | None, ...]:
    window = config.get("sliding_window")
    if config.get("layer_types"):
        return tuple(window if t == "sliding_attention" else None for t in config["layer_types"])
    if window and (config["model_type"] == "mixtral" or config.get("use_sliding_window")):
        if config["model_type"] != "mixtral":
            raise ValueError(f"{config['model_type']}: use_sliding_window without layer_types is not supported")
        return (int(window),) * n
    return (None,) * n


def spec_from_config(config: Mapping[str, Any]) -> DecoderSpec:
    """DecoderSpec of an HF config.json dict; ValueError for an unknown model_type."""
    if config.get("model_type") not in FAMILIES:
        raise ValueError(f"unsupported model_type {config.get('model_type')!r}; supported: {FAMILIES}")
    kind = family(config)
    n = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    rope = _rope_params(config)
    moe = set(moe_layer_indices(config))
    mla = None
    rope_dim = head_dim
    if kind == "deepseek_v3":
        nope, rdim = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
        scale = (nope + rdim) ** -0.5
        if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
            factor = float(rope["factor"])
            ms = 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
            scale *= ms * ms
        mla = MLASpec(q_lora_rank=config.get("q_lora_rank"), kv_lora_rank=int(config["kv_lora_rank"]),
                      qk_nope_dim=nope, qk_rope_dim=rdim, v_dim=int(config["v_head_dim"]),
                      rope_interleave=bool(config.get("rope_interleave", True)), softmax_scale=scale)
        rope_dim = rdim
    else:  # GLM-4 MoE rotates only the first partial_rotary_factor of each head
        rope_dim = int(head_dim * float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))))
    inv_freq, attention_factor = rope_inv_freq(rope, rope_dim, int(config.get("max_position_embeddings", 4096)))
    return DecoderSpec(
        model_type=kind, vocab_size=int(config["vocab_size"]), hidden_size=hidden, num_layers=n,
        num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads), head_dim=head_dim,
        eps=float(config.get("rms_norm_eps", 1e-6)), inv_freq=tuple(float(f) for f in inv_freq),
        attention_factor=attention_factor, windows=_windows(config, n),
        ffn=tuple("moe" if i in moe else "dense" for i in range(n)),
        qk_norm=kind == "qwen3_moe" or (kind == "glm4_moe" and bool(config.get("use_qk_norm", False))),
        attention_bias=kind != "glm4_moe" and bool(config.get("attention_bias", False)),
        qkv_bias=((kind == "qwen2_moe" and bool(config.get("qkv_bias", True)))
                  or (kind == "glm4_moe" and bool(config.get("attention_bias", False)))),
        rotary_dim=None if rope_dim == head_dim or kind == "deepseek_v3" else rope_dim,
        sinks=kind == "gpt_oss", tie_word_embeddings=bool(config.get("tie_word_embeddings", False)), mla=mla)
