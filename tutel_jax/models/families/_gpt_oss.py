"""GPT-OSS (`model_type: gpt_oss`).

Attention: GQA with q/k/v/o biases (attention_bias), a per-head sink logit `self_attn.sinks`, sliding windows
per layer_types. MoE on every layer: `mlp.router.weight` [E, H] + `mlp.router.bias` [E], top-k logits then
softmax; fused experts `mlp.experts.gate_up_proj` [E, H, 2I] (gate / up interleaved) + `gate_up_proj_bias`,
`down_proj` [E, I, H] + `down_proj_bias`, clamped SwiGLU (swiglu_limit, swiglu_alpha); no shared expert.
"""

from __future__ import annotations

from ...validation import Field
from .._family import Family, register_family

__all__ = ["GPT_OSS"]


def _router(config, found) -> dict:
    return {"type": "gpt_oss"}


def _experts(config) -> dict:
    return {"type": "gpt_oss", "swiglu_limit": float(config.get("swiglu_limit", 7.0)),
            "swiglu_alpha": float(config.get("swiglu_alpha", 1.702))}


GPT_OSS = register_family(Family(
    name="gpt_oss", router=_router, router_tensors={"weight": "router.weight", "bias": "router.bias"},
    experts=_experts, fused_experts=("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"),
    sinks=True, config_fields=(Field("swiglu_limit", "real", nullable=False, minimum=0, exclusive_min=True),
                               Field("swiglu_alpha", "real", nullable=False))))
