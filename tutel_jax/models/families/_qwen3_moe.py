"""Qwen3-MoE (`model_type: qwen3_moe`).

Attention: GQA, RMSNorm [D] on each q / k head (`self_attn.{q,k}_norm.weight`), biases when attention_bias.
MoE: `mlp.gate.weight` [E, H], softmax over the experts then top-k, renormalised when norm_topk_prob;
per-expert SwiGLU `mlp.experts.{e}.{gate,up,down}_proj.weight`; no shared expert. Layer i is MoE unless it is in
mlp_only_layers or (i + 1) is not a multiple of decoder_sparse_step (then a dense `mlp.{gate,up,down}_proj`).
"""

from __future__ import annotations

from .._family import SPARSE_STEP_FIELDS, Family, constant, register_family

__all__ = ["QWEN3_MOE", "softmax_topk_router", "sparse_step_layers"]


def sparse_step_layers(config) -> list[int]:
    """HF Qwen-MoE's MoE layers: not in mlp_only_layers, and (i + 1) % decoder_sparse_step == 0."""
    only_mlp = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step", 1))
    return [i for i in range(int(config["num_hidden_layers"])) if i not in only_mlp and (i + 1) % step == 0]


def softmax_topk_router(config, found) -> dict:
    """Softmax over all experts, top-k, renormalised when norm_topk_prob (HF default False)."""
    return {"type": "qwen3_moe", "norm_topk_prob": bool(config.get("norm_topk_prob", False))}


QWEN3_MOE = register_family(Family(name="qwen3_moe", router=softmax_topk_router, moe_layers=sparse_step_layers,
                                   qk_norm=constant("head"), config_fields=SPARSE_STEP_FIELDS))
