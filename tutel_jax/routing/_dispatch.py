"""Tutel's dispatch (fast_encode) and combine (fast_decode) on a routing plan, and the dropless permute pair.

The ops are `pallas_kernels.dispatch`'s index gathers, each the other's transpose:
  encode:  D[slot] = w[a] * x[token(a)]     for the assignment a that owns the slot (zero for an empty slot)
  decode:  y[s]    = sum_j w_j[s] * O[slot_j(s)]   (zero for a dropped assignment)
`encode` / `decode` here are their plain-JAX references (custom VJPs: backward is gathers too, never a
scatter-add over [E, C, M]; no one-hot [S, E, C] tensor is ever formed); a kernel backend replaces them where
`core.kernels` resolves to one. This module maps a plan onto slots:
  - the capacity buffer [E, C, M]: slot = expert * C + location, dropped when location >= capacity;
  - the dropless grouped layout [k*S, M], rows sorted by expert: slot = start(expert) + location.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels.dispatch import decode_reference as decode
from pallas_kernels.dispatch import encode_reference as encode
from pallas_kernels.dispatch import gather_encode, grouped_rows, slot_owner

from .. import core
from ._plan import RoutingPlan

__all__ = [
    "encode", "decode", "fast_encode", "fast_decode", "buffer_slots", "grouped_slots", "group_row_experts",
    "assignment_weights",
]


def buffer_slots(plan: RoutingPlan) -> jax.Array:
    """[k, S] flat slots in the [E * C] buffer; dropped assignments get E * C (out of range)."""
    cap = plan.buffer_capacity
    if cap is None:
        raise ValueError("this routing plan has no buffer capacity (dropless); use grouped_slots() "
                         "or plan.with_buffer_capacity(C)")
    dropped_slot = plan.num_experts * cap
    return jnp.where(plan.kept, plan.expert_ids * cap + plan.locations, dropped_slot).astype(jnp.int32)


def grouped_slots(plan: RoutingPlan) -> jax.Array:
    """[k, S] rows of the dropless layout [k*S, M], sorted by expert in Tutel's slot order."""
    return grouped_rows(plan.expert_ids, plan.locations, plan.dispatch_count)


def group_row_experts(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """[num_rows] int32 expert owning each row of a grouped layout with these group sizes."""
    return jnp.repeat(jnp.arange(group_sizes.shape[0], dtype=jnp.int32), group_sizes,
                      total_repeat_length=num_rows)


# Plans with more choices per token than this (expert choice: k = E) use the slot-major formulation below,
# whose cost is O(slots * M) whatever k; the per-choice loops above cost O(k * S * M).
SLOT_MAJOR_MIN_K = 9


def _decode_slot_major(data: jax.Array, weights: jax.Array, slots: jax.Array) -> jax.Array:
    """decode() as one gather + scatter-add over slots (plain autodiff): y[token(a)] += w[a] * data[slot(a)]."""
    k, num_tokens = weights.shape
    owner = slot_owner(slots, data.shape[0])
    token = jnp.where(owner < k * num_tokens, owner % num_tokens, num_tokens)
    w = jnp.take(weights.reshape(-1), owner, mode="fill", fill_value=0)
    contrib = data * w[:, None].astype(data.dtype)
    return jnp.zeros((num_tokens, data.shape[1]), data.dtype).at[token].add(contrib, mode="drop")


def _encode_weights(plan: RoutingPlan, is_postscore: bool) -> jax.Array:
    return jnp.ones_like(plan.gates) if is_postscore else plan.gates


def _decode_weights(plan: RoutingPlan, is_postscore: bool) -> jax.Array:
    return plan.gates if is_postscore else jnp.ones_like(plan.gates)


def assignment_weights(plan: RoutingPlan, is_postscore: bool = True) -> tuple[jax.Array, jax.Array]:
    """(input weights, output weights) [k, S] of every assignment (gates on one side, ones on the other),
    zero for assignments the plan does not keep (dropped or padding tokens)."""
    keep = plan.kept.astype(plan.gates.dtype)
    return _encode_weights(plan, is_postscore) * keep, _decode_weights(plan, is_postscore) * keep


def _kernel_op(name: str, backend: str | None, top_k: int):
    """The pallas_kernels version of an op when `backend` resolves to kernels (`core.kernels`: the
    platform's kernels by default), else None (this module's XLA version)."""
    backend = core.kernels(backend)
    if backend is None or top_k >= SLOT_MAJOR_MIN_K:
        return None
    op = getattr(pallas_kernels, name)
    return lambda *args: op(*args, implementation=backend)


def fast_encode(x: jax.Array, plan: RoutingPlan, is_postscore: bool = True, backend: str | None = None
                ) -> jax.Array:
    """Tutel's `fast_encode`: [S, M] tokens -> [E, C, M] expert buffer.

    With `is_postscore` tokens are copied as they are (weights applied at decode); otherwise each is scaled by
    its gate weight. Computed in the gate's dtype, like Tutel; the caller casts back. `backend` selects the
    `pallas_kernels` implementation (see `core.kernels`: None / 'auto' is the compile platform's kernels,
    'xla' this module's gathers).
    """
    cap = plan.buffer_capacity
    slots = buffer_slots(plan)
    x = x.astype(plan.gates.dtype)
    weights, num_slots = _encode_weights(plan, is_postscore), plan.num_experts * cap
    if plan.top_k >= SLOT_MAJOR_MIN_K:  # gathers per slot; autodiff's transpose is a scatter-add per slot
        flat = gather_encode(x, weights, slots, num_slots)
    else:
        flat = (_kernel_op("encode", backend, plan.top_k) or encode)(x, weights, slots, num_slots)
    return flat.reshape(plan.num_experts, cap, x.shape[-1])


def fast_decode(data: jax.Array, plan: RoutingPlan, is_postscore: bool = True, backend: str | None = None
                ) -> jax.Array:
    """Tutel's `fast_decode`: [E, C, M] expert outputs -> [S, M] tokens (a fully dropped token gets 0)."""
    num_experts, cap, dim = data.shape
    if cap != plan.buffer_capacity or num_experts != plan.num_experts:
        raise ValueError(f"data must be [E={plan.num_experts}, C={plan.buffer_capacity}, M], got {data.shape}")
    flat = data.reshape(num_experts * cap, dim).astype(plan.gates.dtype)
    if plan.top_k >= SLOT_MAJOR_MIN_K:
        return _decode_slot_major(flat, _decode_weights(plan, is_postscore), buffer_slots(plan))
    op = _kernel_op("decode", backend, plan.top_k) or decode
    return op(flat, _decode_weights(plan, is_postscore), buffer_slots(plan))


def permute(x: jax.Array, plan: RoutingPlan, is_postscore: bool = True, backend: str | None = None) -> jax.Array:
    """Dropless: [S, M] -> [k*S, M] rows sorted by expert (group sizes = plan.dispatch_count)."""
    x = x.astype(plan.gates.dtype)
    op = _kernel_op("encode", backend, plan.top_k) or encode
    return op(x, _encode_weights(plan, is_postscore), grouped_slots(plan), plan.gates.size)


def unpermute(rows: jax.Array, plan: RoutingPlan, is_postscore: bool = True, backend: str | None = None
              ) -> jax.Array:
    """Dropless: [k*S, M] expert outputs sorted by expert -> [S, M]."""
    op = _kernel_op("decode", backend, plan.top_k) or decode
    return op(rows.astype(plan.gates.dtype), _decode_weights(plan, is_postscore), grouped_slots(plan))
