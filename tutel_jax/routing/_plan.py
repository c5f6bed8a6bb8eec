"""Tutel's top-k routing: from gate scores to a routing plan.

A routing plan says, for each of the k choices of each token, which expert it goes to (`expert_ids`), which slot
of that expert's buffer it takes (`locations`), and with what weight it is combined (`gates`). Slots follow
Tutel's rule: every first choice is placed before any second choice, and within one choice tokens are placed in
token order (or in descending order of their best score with `batch_prioritized_routing`). A choice is dropped
when its slot is at or beyond the capacity.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from pallas_kernels.gating import slot_positions_reference as slot_positions
from pallas_kernels.gating import normalize_weights

from ..validation import check_int

__all__ = ["RoutingPlan", "top_k_routing", "plan_from_choices", "static_capacity", "align_capacity", "slot_positions"]


@dataclasses.dataclass(frozen=True)
class RoutingPlan:
    """Where every (choice, token) assignment goes.

    Attributes:
      expert_ids: [k, S] int32, expert of choice j of token s (descending score order).
      locations: [k, S] int32, slot of that assignment inside its expert, counted before dropping; the assignment
        is dropped when `locations >= capacity`.
      gates: [k, S] float, combine weight of that assignment (normalised over the k choices when k > 1 and
        `normalize_gate`; the normalisation includes choices that are dropped later, as in Tutel).
      dispatch_count: [E] int32, assignments routed to each expert before dropping.
      capacity: [] int32, Tutel's capacity C (after alignment). It may be data dependent (capacity_factor <= 0).
      num_experts: E (static).
      buffer_capacity: static number of slots per expert of the [E, C, M] buffer, >= `capacity`; None for a
        plan meant for the dropless grouped path, which has no buffer.
    """

    expert_ids: jax.Array
    locations: jax.Array
    gates: jax.Array
    dispatch_count: jax.Array
    capacity: jax.Array
    num_experts: int
    buffer_capacity: int | None

    @property
    def top_k(self) -> int:
        return self.expert_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.expert_ids.shape[1]

    @property
    def kept(self) -> jax.Array:
        """[k, S] bool, True where the assignment fits within the capacity."""
        return self.locations < self.capacity

    @property
    def dropped_fraction(self) -> jax.Array:
        """[] float32, fraction of the k*S assignments dropped for lack of capacity."""
        return jnp.sum(~self.kept).astype(jnp.float32) / max(self.kept.size, 1)  # no assignment: 0, not 0 / 0

    def with_buffer_capacity(self, buffer_capacity: int) -> "RoutingPlan":
        """The same plan laid out in a buffer of `buffer_capacity` slots per expert (assignments beyond it drop)."""
        return dataclasses.replace(
            self,
            buffer_capacity=int(buffer_capacity),
            capacity=jnp.minimum(self.capacity, jnp.int32(buffer_capacity)),
        )


jax.tree_util.register_dataclass(
    RoutingPlan,
    data_fields=["expert_ids", "locations", "gates", "dispatch_count", "capacity"],
    meta_fields=["num_experts", "buffer_capacity"],
)


def align_capacity(capacity, alignment: int):
    """Rounds `capacity` up to a multiple of `alignment` (Tutel: an alignment above 256 becomes 128)."""
    alignment = check_int(alignment, "alignment", minimum=1)
    if alignment > 256:
        alignment = 128
    if isinstance(capacity, int):
        return -(-capacity // alignment) * alignment
    return (capacity + alignment - 1) // alignment * alignment


def capacity_formula(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Tutel's unaligned capacity bound `k * int(|cf| * ceil(S / E))` (for cf > 0 the capacity itself)."""
    samples_per_expert = -(-num_tokens // num_experts)
    return top_k * int(abs(capacity_factor) * samples_per_expert)


def static_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float, alignment: int = 1
                    ) -> int | None:
    """The static buffer capacity for a capacity factor, or None for dropless (capacity_factor == 0).

    capacity_factor > 0: `k * int(cf * ceil(S / E))`, Tutel's capacity itself.
    capacity_factor < 0: the bound `k * int(-cf * ceil(S / E))`; Tutel's capacity is min(max count, bound), which
      drops exactly the same assignments as the bound does, since no slot reaches the max count.
    """
    if capacity_factor == 0:
        return None
    # at least one slot: a capacity of 0 drops everything, but the buffer keeps a (zero) row per expert
    return align_capacity(max(capacity_formula(num_tokens, num_experts, top_k, capacity_factor), 1), alignment)


def _dynamic_bound(num_tokens, max_tokens: int, num_experts: int, top_k: int, capacity_factor: float):
    """`capacity_formula` for a traced token count <= max_tokens, exactly (a table, no float rounding)."""
    table = [capacity_formula(s, num_experts, top_k, capacity_factor) for s in range(max_tokens + 1)]
    return jnp.asarray(table, jnp.int32)[jnp.clip(num_tokens, 0, max_tokens)]


def top_k_routing(
    scores: jax.Array,
    top_k: int,
    capacity_factor: float = 1.0,
    *,
    batch_prioritized_routing: bool = False,
    normalize_gate: bool = True,
    alignment: int = 1,
    valid: jax.Array | None = None,
    num_tokens_for_capacity: int | jax.Array | None = None,
    max_count_reduce=None,
) -> RoutingPlan:
    """Tutel's `extract_critical`: top-k choices, slots, combine weights and capacity.

    Args:
      scores: [S, E] routing probabilities (softmax of the possibly noisy logits).
      top_k: k >= 1; clipped to E like Tutel.
      capacity_factor: > 0 fixed capacity `k * int(cf * ceil(S/E))`; == 0 dropless (C = max count);
        < 0 `min(max count, k * int(-cf * ceil(S/E)))`.
      batch_prioritized_routing: place tokens in descending order of their best score (stable sort).
      normalize_gate: for k > 1, divide the k weights by max(sum, eps).
      alignment: round the capacity up to a multiple of this (sharded count x overlap degree).
      valid: optional [S] bool; False marks padding tokens, which take no slot, count nowhere and get weight 0.
      num_tokens_for_capacity: S used in `ceil(S / E)`, a Python int or a traced count <= S; defaults to the
        number of valid tokens. Expert parallelism with unequal token counts passes the maximum over ranks.
      max_count_reduce: optional function applied to the local max dispatch count (e.g. a `pmax` over the
        expert-parallel group) so that every rank agrees on the capacity.

    Returns:
      A RoutingPlan. `buffer_capacity` is the static buffer size (None for capacity_factor == 0).
    """
    if scores.ndim != 2:
        raise ValueError(f"scores must be [S, E], got shape {scores.shape}")
    num_tokens, num_experts = scores.shape
    top_k = min(check_int(top_k, "top_k", minimum=1), num_experts)

    top_scores, top_ids = jax.lax.top_k(scores, top_k)  # descending, ties to the lower expert index
    expert_ids = top_ids.T.astype(jnp.int32)  # [k, S]
    gates = top_scores.T  # [k, S]
    if valid is not None:
        gates = jnp.where(valid[None, :], gates, 0)
    gates = normalize_weights(gates, "softmax", normalize_gate)
    priority = jnp.max(scores, axis=1) if batch_prioritized_routing else None
    return plan_from_choices(
        expert_ids, gates, num_experts, capacity_factor, priority=priority, alignment=alignment, valid=valid,
        num_tokens_for_capacity=num_tokens_for_capacity, max_count_reduce=max_count_reduce)


def plan_from_choices(
    expert_ids: jax.Array,
    gates: jax.Array,
    num_experts: int,
    capacity_factor: float = 1.0,
    *,
    priority: jax.Array | None = None,
    alignment: int = 1,
    valid: jax.Array | None = None,
    num_tokens_for_capacity: int | jax.Array | None = None,
    max_count_reduce=None,
    slots: tuple[jax.Array, jax.Array] | None = None,
) -> RoutingPlan:
    """A routing plan from any router's choices: Tutel's slots, counts and capacity for given experts and weights.

    Args:
      expert_ids: [k, S] int, expert of choice j of token s (the k experts of a token must be distinct).
      gates: [k, S] float combine weights, final (no normalisation is applied here).
      num_experts: E.
      capacity_factor: > 0 fixed capacity `k * int(cf * ceil(S/E))`; == 0 dropless (C = max count);
        < 0 `min(max count, k * int(-cf * ceil(S/E)))` (Tutel's rules).
      priority: optional [S] scores; tokens are placed in descending order of priority (stable sort), i.e.
        Tutel's batch-prioritized routing when it is the best score of each token. None: token order.
      alignment, valid, num_tokens_for_capacity, max_count_reduce: as in `top_k_routing`. Padding tokens
        (valid False) take no slot, count nowhere and get weight 0.
      slots: optional precomputed (locations [k, S], counts [E]) in Tutel's order (e.g. from the fused gating
        kernel); only without `valid`.

    Returns:
      A RoutingPlan; `buffer_capacity` is None for capacity_factor == 0.
    """
    if expert_ids.ndim != 2 or gates.shape != expert_ids.shape:
        raise ValueError(f"expert_ids and gates must both be [k, S], got {expert_ids.shape} and {gates.shape}")
    top_k, num_tokens = expert_ids.shape
    expert_ids = expert_ids.astype(jnp.int32)
    slot_ids, num_slot_experts = expert_ids, num_experts
    if valid is not None:  # padding tokens go to an extra expert E, placed after every real one
        slot_ids, num_slot_experts = jnp.where(valid[None, :], expert_ids, num_experts), num_experts + 1
        gates = jnp.where(valid[None, :], gates, 0)
    order = None
    if priority is not None:
        order = jnp.argsort(-(priority if valid is None else jnp.where(valid, priority, -jnp.inf)), stable=True)
    if slots is not None:
        if valid is not None:
            raise ValueError("precomputed slots cannot be combined with a padding mask (valid)")
        locations, counts = slots
    else:
        locations, counts = slot_positions(slot_ids, num_slot_experts, order)
    counts = counts[:num_experts]
    if valid is not None:
        locations = jnp.where(valid[None, :], locations, jnp.iinfo(jnp.int32).max)

    if num_tokens_for_capacity is None:
        num_tokens_for_capacity = num_tokens if valid is None else jnp.sum(valid.astype(jnp.int32))
    buffer_capacity = static_capacity(num_tokens, num_experts, top_k, capacity_factor, alignment)
    if isinstance(num_tokens_for_capacity, int):
        if num_tokens_for_capacity > num_tokens:  # more tokens elsewhere than here: the buffer follows them
            buffer_capacity = static_capacity(num_tokens_for_capacity, num_experts, top_k, capacity_factor, alignment)
        bound = jnp.asarray(capacity_formula(num_tokens_for_capacity, num_experts, top_k, capacity_factor), jnp.int32)
    else:
        bound = _dynamic_bound(num_tokens_for_capacity, num_tokens, num_experts, top_k, capacity_factor)
    max_count = jnp.max(counts)
    if max_count_reduce is not None:
        max_count = max_count_reduce(max_count)
    if capacity_factor > 0:
        capacity = bound
    elif capacity_factor == 0:
        capacity = max_count
    else:
        capacity = jnp.minimum(max_count, bound)
    capacity = align_capacity(capacity, alignment).astype(jnp.int32)

    return RoutingPlan(
        expert_ids=expert_ids,
        locations=locations,
        gates=gates,
        dispatch_count=counts,
        capacity=capacity,
        num_experts=num_experts,
        buffer_capacity=buffer_capacity,
    )
