"""GLM-4 MoE (`model_type: glm4_moe`).

Attention: GQA with q/k/v biases when attention_bias (no o bias), RMSNorm [D] per q / k head when use_qk_norm,
RoPE on the first partial_rotary_factor of each head. MoE: DeepSeek-V3's block (router tensors, layers from
first_k_dense_replace on, shared experts), except that HF's GLM-4 MoE router masks dropped groups with -inf
(DeepSeek-V3: 0.0).
"""

from __future__ import annotations

from ...validation import Field
from .._family import GROUPED_ROUTER_FIELDS, Family, config_flag, constant, register_family
from ._deepseek_v3 import CORRECTION_BIAS, dense_prefix_layers, grouped_sigmoid_router, shared_experts

__all__ = ["GLM4_MOE"]


def _router(config, found) -> dict:
    return {**grouped_sigmoid_router(config, found), "group_mask_value": float("-inf")}


def _qk_norm(config) -> str | None:
    return "head" if config.get("use_qk_norm", False) else None


GLM4_MOE = register_family(Family(name="glm4_moe", router=_router, optional_router_tensors=CORRECTION_BIAS,
                                  moe_layers=dense_prefix_layers, shared_experts=shared_experts, qk_norm=_qk_norm,
                                  attention_bias=constant(False), qkv_bias=config_flag("attention_bias"),
                                  config_fields=GROUPED_ROUTER_FIELDS + (Field("use_qk_norm", "bool", nullable=False),)))
