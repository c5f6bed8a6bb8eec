"""Qwen2-MoE (`model_type: qwen2_moe`).

As Qwen3-MoE (router, experts, MoE layers) without q/k norm, with q/k/v biases (qkv_bias, default True) and a
sigmoid-gated shared expert: `mlp.shared_expert.{gate,up,down}_proj.weight` of width
shared_expert_intermediate_size, scaled per token by sigmoid(x @ `mlp.shared_expert_gate.weight`.T) [1, H].
"""

from __future__ import annotations

from ...validation import Field
from .._family import MAX_WIDTH, SPARSE_STEP_FIELDS, Family, SharedExpertTensors, config_flag, register_family
from ._qwen3_moe import softmax_topk_router, sparse_step_layers

__all__ = ["QWEN2_MOE"]


def _shared_expert(config) -> SharedExpertTensors | None:
    size = config.get("shared_expert_intermediate_size")
    return SharedExpertTensors("shared_expert.", int(size), gate="shared_expert_gate.weight") if size else None


QWEN2_MOE = register_family(Family(name="qwen2_moe", router=softmax_topk_router, moe_layers=sparse_step_layers,
                                   qkv_bias=config_flag("qkv_bias", True), shared_experts=_shared_expert,
                                   config_fields=SPARSE_STEP_FIELDS + (
                                       Field("qkv_bias", "bool", nullable=False),
                                       Field("shared_expert_intermediate_size", "int", minimum=0,
                                             maximum=MAX_WIDTH))))
