"""Mixtral (`model_type: mixtral`).

Attention: GQA without biases; sliding_window (when set) on every layer. MoE on every layer under
`block_sparse_moe.`: `gate.weight` [E, H], softmax top-k renormalised; per-expert SwiGLU
`experts.{e}.w1` (gate) / `w3` (up) [I, H], `w2` (down) [H, I]; no shared expert.
"""

from __future__ import annotations

from .._family import Family, register_family

__all__ = ["MIXTRAL"]


def _router(config, found) -> dict:
    return {"type": "mixtral"}


MIXTRAL = register_family(Family(name="mixtral", router=_router, ffn_prefix="block_sparse_moe.",
                                 expert_names=("w1", "w3", "w2"), sliding_window_every_layer=True))
