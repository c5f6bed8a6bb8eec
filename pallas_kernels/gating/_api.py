"""The gating ops, one for every backend: `gating(logits[S, E], k, ...) -> GatingResult` and its building block
`slot_positions(expert_ids[k, S], E) -> (locations[k, S], counts[E])`.

Semantics: _reference.py. `implementation` picks the backend (`_select.choose`): "xla" (the reference), "pallas" /
"interpret" (_pallas_triton.py; up to `MAX_KERNEL_EXPERTS` experts, "auto" falls back to the reference beyond).
No VJP: gating's outputs are indices, counts and weights of a forward pass (routers that train their weights
use the library's differentiable routing).
"""

from __future__ import annotations

import jax

from .._select import choose
from ._pallas_triton import (MAX_KERNEL_EXPERTS, GatingConfig, check_kernel_experts, default_gating_config,
                            gating_triton, slot_positions_triton)
from ._reference import GatingResult, check_gating_args, gating_reference, slot_positions_reference

__all__ = ["gating", "slot_positions"]


def slot_positions(
    expert_ids: jax.Array,
    num_experts: int,
    priority_order: jax.Array | None = None,
    *,
    implementation: str | None = "auto",
    config: GatingConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Tutel's slot of every assignment and the per-expert counts.

    Args:
      expert_ids: [k, S] int32 in [0, E).
      num_experts: E.
      priority_order: optional [S] permutation: tokens are placed in this order instead of token order.
      implementation: "auto", "xla", "pallas" or "interpret".
      config: kernel tiling (default: `default_gating_config`).

    Returns:
      (locations [k, S] int32, counts [E] int32), equal to `slot_positions_reference`.
    """
    k, num_tokens = expert_ids.shape
    impl = choose(implementation, check_kernel_experts(num_experts, MAX_KERNEL_EXPERTS))
    if impl == "xla":
        return slot_positions_reference(expert_ids, num_experts, priority_order)
    cfg = config or default_gating_config(num_tokens, num_experts)
    return slot_positions_triton(expert_ids, num_experts, cfg, impl == "interpret", priority_order)


def gating(
    logits: jax.Array,
    top_k: int,
    *,
    score_fn: str = "softmax",
    correction_bias: jax.Array | None = None,
    n_group: int = 1,
    topk_group: int | None = None,
    group_fill_value: float = 0.0,
    normalize: bool = True,
    routed_scaling_factor: float = 1.0,
    batch_prioritized_routing: bool = False,
    implementation: str | None = "auto",
    config: GatingConfig | None = None,
) -> GatingResult:
    """Router scores, top-k choices, combine weights and Tutel slot locations (see the module docstring).

    Args:
      logits: [S, E] router logits (any float dtype; computed in float32).
      top_k: k >= 1, clipped to E like Tutel.
      score_fn: "softmax" or "sigmoid".
      correction_bias: optional [E] bias added to the scores for selection only (DeepSeek-V3).
      n_group, topk_group: group-limited selection (DeepSeek-V3's n_group / topk_group); n_group=1 disables it.
      group_fill_value: selection score given to experts of dropped groups (HF: 0.0; DeepSeek inference: -inf).
      normalize: Tutel's normalize_gate (softmax) or HF's norm_topk_prob (sigmoid).
      routed_scaling_factor: multiplies the final weights.
      batch_prioritized_routing: place tokens in descending order of their best score (Tutel).
      implementation: "auto", "xla", "pallas" or "interpret".
      config: kernel tiling (default: `default_gating_config`).

    Returns:
      GatingResult; no token is dropped here (compare locations with the capacity).
    """
    num_experts, k, n_group, topk_group = check_gating_args(logits, top_k, score_fn, correction_bias, n_group,
                                                            topk_group)
    impl = choose(implementation, check_kernel_experts(num_experts, MAX_KERNEL_EXPERTS, n_group))
    options = dict(score_fn=score_fn, correction_bias=correction_bias, group_fill_value=group_fill_value,
                   normalize=normalize, routed_scaling_factor=routed_scaling_factor,
                   batch_prioritized_routing=batch_prioritized_routing)
    if impl == "xla":
        return gating_reference(logits, k, n_group=n_group, topk_group=topk_group, **options)
    return gating_triton(logits, k, num_experts, n_group, topk_group, cfg=config, interpret=impl == "interpret",
                         **options)
