"""OLMoE (`model_type: olmoe`, allenai/OLMoE-1B-7B).

Attention: GQA (MHA in the released models), q/k/v/o biases when attention_bias, RMSNorm over the whole q
projection [Hq*D] and k projection [Hkv*D] before the split into heads (`self_attn.{q,k}_norm.weight`), RoPE.
clip_qkv (clamping q/k/v) is refused unless null, as in the released checkpoints. MoE on every layer, as
Qwen3-MoE: `mlp.gate.weight` [E, H], softmax top-k renormalised when norm_topk_prob (default False); per-expert
SwiGLU `mlp.experts.{e}.{gate,up,down}_proj.weight` of width intermediate_size; no shared expert.
"""

from __future__ import annotations

from ...validation import Field
from .._family import Family, constant, register_family
from ._qwen3_moe import softmax_topk_router

__all__ = ["OLMOE"]


def _check(config) -> None:
    if config.get("clip_qkv") is not None:
        raise ValueError(f"olmoe: clip_qkv={config['clip_qkv']!r} is not supported (only null)")


OLMOE = register_family(Family(name="olmoe", router=softmax_topk_router, qk_norm=constant("projection"),
                               check_config=_check, config_fields=(Field("norm_topk_prob", "bool", nullable=False),)))
