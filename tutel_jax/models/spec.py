"""DecoderSpec: the static shape of an HF MoE decoder, read from its config.json through its family's record
(`models.families`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .families import family_names, family_of
from .family import Family
from .layers import rope_inv_freq

__all__ = ["FAMILIES", "MLASpec", "DecoderSpec", "spec_from_config"]

#: every supported model_type (families, then aliases); see `models.families`
FAMILIES = family_names()


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
    qk_norm: str | None = None  # None, 'head' (RMSNorm [D] per head) or 'projection' (over [H*D], OLMoE)
    attention_bias: bool = False  # q/k/v/o biases (GPT-OSS)
    qkv_bias: bool = False  # q/k/v biases only (Qwen2-MoE, GLM-4 MoE)
    rotary_dim: int | None = None  # RoPE on the first rotary_dim dims of each head (GLM-4 MoE); None: all
    sinks: bool = False
    tie_word_embeddings: bool = False
    mla: MLASpec | None = None
    dense_impl: str = "auto"  # the dense projections' matmul: see `layers.linear` (from_pretrained's dense_impl)

    @property
    def last_moe_layer(self) -> int | None:
        moe = [i for i, f in enumerate(self.ffn) if f == "moe"]
        return moe[-1] if moe else None


def _rope_params(config: Mapping[str, Any]) -> dict:
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return rope


def _windows(config: Mapping[str, Any], n: int, family: Family) -> tuple[int | None, ...]:
    window = config.get("sliding_window")
    if config.get("layer_types"):
        return tuple(window if t == "sliding_attention" else None for t in config["layer_types"])
    if window and family.sliding_window_every_layer:
        return (int(window),) * n
    if window and config.get("use_sliding_window"):
        raise ValueError(f"{config['model_type']}: use_sliding_window without layer_types is not supported")
    return (None,) * n


def spec_from_config(config: Mapping[str, Any]) -> DecoderSpec:
    """DecoderSpec of an HF config.json dict; ValueError for an unknown model_type."""
    family = family_of(config)
    family.check_config(config)
    n = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    rope = _rope_params(config)
    moe = set(family.moe_layers(config))
    mla = None
    if family.mla is not None:
        mla = MLASpec(**family.mla(config, rope))
        rope_dim = mla.qk_rope_dim
    else:  # e.g. GLM-4 MoE rotates only the first partial_rotary_factor of each head
        rope_dim = int(head_dim * float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))))
    inv_freq, attention_factor = rope_inv_freq(rope, rope_dim, int(config.get("max_position_embeddings", 4096)))
    return DecoderSpec(
        model_type=family.name, vocab_size=int(config["vocab_size"]), hidden_size=hidden, num_layers=n,
        num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads), head_dim=head_dim,
        eps=float(config.get("rms_norm_eps", 1e-6)), inv_freq=tuple(float(f) for f in inv_freq),
        attention_factor=attention_factor, windows=_windows(config, n, family),
        ffn=tuple("moe" if i in moe else "dense" for i in range(n)),
        qk_norm=family.qk_norm(config), attention_bias=family.attention_bias(config),
        qkv_bias=family.qkv_bias(config), rotary_dim=None if rope_dim == head_dim or mla is not None else rope_dim,
        sinks=family.sinks, tie_word_embeddings=bool(config.get("tie_word_embeddings", False)), mla=mla)
