"""DeepSeek-V3 (`model_type: deepseek_v3`; also `kimi_k2`, which ships the same architecture).

Attention: multi-head latent attention (q LoRA or a plain q_proj, compressed kv, RoPE on qk_rope_head_dim;
softmax scale times YaRN's mscale(factor, mscale_all_dim)^2). MoE from layer first_k_dense_replace on:
`mlp.gate.weight` [E, H] (+ `mlp.gate.e_score_correction_bias` [E] when present), sigmoid scores, group-limited
top-k (n_group, topk_group; dropped groups masked with 0), renormalised when norm_topk_prob (default True), times
routed_scaling_factor; per-expert SwiGLU `mlp.experts.{e}.{gate,up,down}_proj`; n_shared_experts ungated shared
experts `mlp.shared_experts.{gate,up,down}_proj` of width moe_intermediate_size x n_shared_experts.
"""

from __future__ import annotations

import math

from ...validation import Field
from .._family import (GROUPED_ROUTER_FIELDS, MAX_HEAD_DIM, MAX_WIDTH, Family, SharedExpertTensors, moe_hidden_size,
                      register_family)

__all__ = ["DEEPSEEK_V3", "dense_prefix_layers", "grouped_sigmoid_router", "shared_experts", "CORRECTION_BIAS",
           "MLA_FIELDS"]

#: the optional router tensor (gate parameter -> on-disk name under `mlp.`)
CORRECTION_BIAS = {"e_score_correction_bias": "gate.e_score_correction_bias"}


def dense_prefix_layers(config) -> list[int]:
    """HF: every layer from first_k_dense_replace on is MoE."""
    first = int(config.get("first_k_dense_replace", 0))
    return [i for i in range(int(config["num_hidden_layers"])) if i >= first]


def grouped_sigmoid_router(config, found) -> dict:
    """Sigmoid scores (+ the correction bias for the choice), group-limited top-k, routed_scaling_factor."""
    return {"type": "deepseek_v3", "n_group": int(config.get("n_group") or 1),
            "topk_group": int(config.get("topk_group") or 1),
            "norm_topk_prob": bool(config.get("norm_topk_prob", True)),
            "routed_scaling_factor": float(config.get("routed_scaling_factor", 1.0)),
            "correction_bias": "e_score_correction_bias" in found}


def shared_experts(config) -> SharedExpertTensors | None:
    """n_shared_experts ungated shared experts as one SwiGLU of n times the routed width."""
    n = int(config.get("n_shared_experts") or 0)
    return SharedExpertTensors("shared_experts.", moe_hidden_size(config) * n) if n else None


#: multi-head latent attention's config.json keys (q_lora_rank null: a plain q_proj)
MLA_FIELDS: tuple[Field, ...] = (
    Field("kv_lora_rank", "int", required=True, minimum=1, maximum=MAX_WIDTH),
    Field("qk_nope_head_dim", "int", required=True, minimum=1, maximum=MAX_HEAD_DIM),
    Field("qk_rope_head_dim", "int", required=True, minimum=2, maximum=MAX_HEAD_DIM),
    Field("v_head_dim", "int", required=True, minimum=1, maximum=MAX_HEAD_DIM),
    Field("q_lora_rank", "int", minimum=1, maximum=MAX_WIDTH),
    Field("rope_interleave", "bool", nullable=False),
)


def _mla(config, rope) -> dict:
    nope, rdim = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
    scale = (nope + rdim) ** -0.5
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = float(rope["factor"])
        ms = 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= ms * ms
    return dict(q_lora_rank=config.get("q_lora_rank"), kv_lora_rank=int(config["kv_lora_rank"]), qk_nope_dim=nope,
                qk_rope_dim=rdim, v_dim=int(config["v_head_dim"]),
                rope_interleave=bool(config.get("rope_interleave", True)), softmax_scale=scale)


DEEPSEEK_V3 = register_family(Family(name="deepseek_v3", aliases=("kimi_k2",), router=grouped_sigmoid_router,
                                     optional_router_tensors=CORRECTION_BIAS, moe_layers=dense_prefix_layers,
                                     shared_experts=shared_experts, mla=_mla,
                                     config_fields=GROUPED_ROUTER_FIELDS + MLA_FIELDS))
