"""Fused gating's semantics in plain JAX: router scores -> top-k -> Tutel slot locations, the reference every
backend equals.

    gating_reference(logits[S, E], k, ...) -> GatingResult(expert_ids[k, S], locations[k, S], weights[k, S],
                                                           counts[E], scores[S, E])
    slot_positions_reference(expert_ids[k, S], E) -> (locations[k, S], counts[E])

Semantics (`gating_reference`; for softmax scores bit-identical to the library's top-k routing, which the tests
check):
  - scores: `softmax(logits)` (Tutel, Mixtral, Qwen) or `sigmoid(logits)` (DeepSeek-V3, Kimi-K2, GLM), in float32.
  - selection score: `scores + correction_bias` (bias optional); with `n_group > 1`, experts form `n_group`
    contiguous groups, a group scores the sum of its two best selection scores, the best `topk_group` groups
    are kept and every other expert's selection score becomes `group_fill_value` (0.0 as in HF transformers;
    DeepSeek's own inference code uses -inf).
  - top-k: descending selection score, ties to the lower expert index (like `lax.top_k`).
  - weights: the UNBIASED score of each chosen expert. softmax: divided by max(sum over k, eps) when
    `normalize` and k > 1 (Tutel's `normalize_gate`); sigmoid: divided by (sum + 1e-20) when `normalize`
    (HF `norm_topk_prob`). Then times `routed_scaling_factor`.
  - locations: Tutel's slots: the number of earlier assignments to the same expert, "earlier" meaning a lower
    choice index, or the same choice and an earlier token (in descending best-score order with
    `batch_prioritized_routing`, stable). counts[e] = assignments to e. Capacity and dropping are left to the
    caller (a slot >= capacity is dropped), exactly as in `top_k_routing`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["GatingResult", "gating_reference", "slot_positions_reference", "check_gating_args", "priority_order",
           "group_limited", "normalize_weights", "SCORE_FNS"]

SCORE_FNS = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class GatingResult:
    """Output of `gating`.

    Attributes:
      expert_ids: [k, S] int32, expert of choice j of token s (descending selection score).
      locations: [k, S] int32, Tutel slot of that assignment inside its expert (before dropping).
      weights: [k, S] float32 combine weights.
      counts: [E] int32 assignments per expert (Tutel's dispatch_count).
      scores: [S, E] float32 router scores (softmax or sigmoid, without the correction bias), for aux losses.
    """

    expert_ids: jax.Array
    locations: jax.Array
    weights: jax.Array
    counts: jax.Array
    scores: jax.Array


jax.tree_util.register_dataclass(
    GatingResult, data_fields=["expert_ids", "locations", "weights", "counts", "scores"], meta_fields=[])


def slot_positions_reference(expert_ids: jax.Array, num_experts: int, priority_order: jax.Array | None = None
                             ) -> tuple[jax.Array, jax.Array]:
    """Slots of every assignment under Tutel's order, and the per-expert counts (a stable sort of the
    choice-major assignment list).

    Args:
      expert_ids: [k, S] int32.
      num_experts: E.
      priority_order: optional [S] permutation; tokens are placed in this order instead of token order.

    Returns:
      locations: [k, S] int32, the number of earlier assignments to the same expert, where "earlier" means a
        lower choice index, or the same choice index and an earlier token in the placement order.
      counts: [E] int32 assignments per expert.
    """
    expert_ids = expert_ids.astype(jnp.int32)
    k, num_tokens = expert_ids.shape
    ordered = expert_ids if priority_order is None else expert_ids[:, priority_order]
    flat = ordered.reshape(-1)  # choice-major, then placement order: exactly Tutel's precedence
    counts = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    starts = jnp.cumsum(counts) - counts
    order = jnp.argsort(flat, stable=True)
    rank = jnp.zeros((k * num_tokens,), jnp.int32).at[order].set(jnp.arange(k * num_tokens, dtype=jnp.int32))
    slots = (rank - starts[flat]).reshape(k, num_tokens)
    if priority_order is not None:
        slots = jnp.zeros_like(slots).at[:, priority_order].set(slots)
    return slots, counts


def group_limited(sel: jax.Array, n_group: int, topk_group: int, fill: float) -> jax.Array:
    """DeepSeek-V3's group-limited selection scores: sel [S, E] with the experts of all but the `topk_group`
    best of `n_group` contiguous groups (a group scores the sum of its two best, or its one expert) set to
    `fill`."""
    num_tokens, num_experts = sel.shape
    group_size = num_experts // n_group
    grouped = sel.reshape(num_tokens, n_group, group_size)
    group_scores = jnp.sum(lax.top_k(grouped, min(2, group_size))[0], axis=-1)  # sum of the two best per group
    _, keep = lax.top_k(group_scores, topk_group)
    group_mask = jnp.zeros((num_tokens, n_group), bool).at[jnp.arange(num_tokens)[:, None], keep].set(True)
    mask = jnp.repeat(group_mask, num_experts // n_group, axis=1)
    return jnp.where(mask, sel, jnp.float32(fill))


def priority_order(scores: jax.Array) -> jax.Array:
    """Tutel's batch-prioritized placement order: descending best score, stable."""
    return jnp.argsort(-jnp.max(scores, axis=1), stable=True)


def gating_reference(
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
) -> GatingResult:
    """Plain-JAX gating with the semantics in the module docstring (same signature as `gating`)."""
    num_experts, k, n_group, topk_group = check_gating_args(logits, top_k, score_fn, correction_bias, n_group,
                                                            topk_group)
    x = logits.astype(jnp.float32)
    scores = jax.nn.softmax(x, axis=1) if score_fn == "softmax" else jax.nn.sigmoid(x)
    sel = scores if correction_bias is None else scores + correction_bias.astype(jnp.float32)[None, :]
    if n_group > 1:
        sel = group_limited(sel, n_group, topk_group, group_fill_value)
    top_sel, top_ids = lax.top_k(sel, k)  # descending, ties to the lower index
    expert_ids = top_ids.T.astype(jnp.int32)  # [k, S]
    # without a bias or group limit the selected values ARE the scores (bit-identical to top_k_routing)
    weights = top_sel.T if sel is scores else jnp.take_along_axis(scores, top_ids, axis=1).T
    weights = normalize_weights(weights, score_fn, normalize, routed_scaling_factor)
    priority = priority_order(scores) if batch_prioritized_routing else None
    locations, counts = slot_positions_reference(expert_ids, num_experts, priority)
    return GatingResult(expert_ids, locations, weights, counts, scores)


def normalize_weights(weights: jax.Array, score_fn: str, normalize: bool, scale: float = 1.0,
                      axis: int = 0) -> jax.Array:
    """The combine weights of the k chosen experts (along `axis` of weights, e.g. [k, S]): with `normalize`,
    Tutel's normalize_gate for softmax scores (divided by max(sum, eps) when k > 1) or HF's norm_topk_prob for
    sigmoid scores (divided by sum + 1e-20); then times `scale` (routed_scaling_factor)."""
    if normalize and score_fn == "softmax" and weights.shape[axis] > 1:  # Tutel normalize_gate
        weights = weights / jnp.maximum(jnp.sum(weights, axis=axis, keepdims=True), jnp.finfo(weights.dtype).eps)
    elif normalize and score_fn == "sigmoid":  # HF norm_topk_prob
        weights = weights / (jnp.sum(weights, axis=axis, keepdims=True) + 1e-20)
    if scale != 1.0:
        weights = weights * jnp.asarray(scale, weights.dtype)
    return weights


def check_gating_args(logits: jax.Array, top_k: int, score_fn: str, correction_bias: jax.Array | None,
                      n_group: int, topk_group: int | None) -> tuple[int, int, int, int]:
    """(E, k clipped to E, n_group, topk_group) of valid gating arguments; ValueError naming the bad one."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [S, E], got shape {logits.shape}")
    num_experts = logits.shape[1]
    if score_fn not in SCORE_FNS:
        raise ValueError(f"score_fn must be one of {SCORE_FNS}, got {score_fn!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}")
    if correction_bias is not None and correction_bias.shape != (num_experts,):
        raise ValueError(f"correction_bias must be [E={num_experts}], got {correction_bias.shape}")
    n_group = int(n_group)
    if n_group < 1 or num_experts % n_group:
        raise ValueError(f"n_group must divide E={num_experts}, got {n_group}")
    if n_group > 1 and num_experts // n_group < 2:
        raise ValueError("group-limited routing needs at least 2 experts per group")
    topk_group = n_group if topk_group is None else int(topk_group)
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
    return num_experts, min(top_k, num_experts), n_group, topk_group
