"""Index-based dispatch (encode) and combine (decode), each the other's transpose.

Both directions are gathers:
  encode:  D[slot] = w[a] * x[token(a)]     for the assignment a that owns the slot (zero for an empty slot)
  decode:  y[s]    = sum_j w_j[s] * O[slot_j(s)]   (zero for a dropped assignment)
The custom VJPs make the gradient of each one the other one (plus k*S dot products for the gate weights), so
backward is gathers too and never a scatter-add over [E, C, M]. Work is O(k * S * M); no one-hot [S, E, C]
tensor is ever formed.

The same pair serves two layouts:
  - the capacity buffer [E, C, M]: slot = expert * C + location, dropped when location >= capacity;
  - the dropless grouped layout [k*S, M], rows sorted by expert: slot = start(expert) + location.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

import pallas_kernels

from . import execution
from .routing.plan import RoutingPlan

__all__ = [
    "encode", "decode", "fast_encode", "fast_decode", "buffer_slots", "grouped_slots", "group_row_experts",
    "assignment_weights",
]


def _slot_owner(slots: jax.Array, num_slots: int) -> jax.Array:
    """[num_slots] int32 index into the flattened [k*S] assignments that fills each slot (k*S when empty)."""
    num_assign = slots.size
    owner = jnp.full((num_slots,), num_assign, jnp.int32)
    return owner.at[slots.reshape(-1)].set(jnp.arange(num_assign, dtype=jnp.int32), mode="drop")


def _encode_impl(x, weights, slots, num_slots):
    k, num_tokens = weights.shape
    owner = _slot_owner(slots, num_slots)
    token = jnp.where(owner < k * num_tokens, owner % num_tokens, num_tokens)
    rows = jnp.take(x, token, axis=0, mode="fill", fill_value=0)
    w = jnp.take(weights.reshape(-1), owner, mode="fill", fill_value=0)
    return rows * w[:, None].astype(rows.dtype)


def _decode_impl(data, weights, slots):
    out = None
    for j in range(weights.shape[0]):  # k is small; summing in choice order matches Tutel
        rows = jnp.take(data, slots[j], axis=0, mode="fill", fill_value=0)
        term = rows * weights[j][:, None].astype(rows.dtype)
        out = term if out is None else out + term
    return out


def _assignment_dots(a, b, weights, slots):
    """[k, S] dot products <a[s], b[slot_j(s)]>, zero for dropped assignments (one gather for all k)."""
    k, num_tokens = slots.shape
    rows = jnp.take(b, slots.reshape(-1), axis=0, mode="fill", fill_value=0).reshape(k, num_tokens, -1)
    dots = jnp.einsum("ksm,sm->ks", rows.astype(jnp.float32), a.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    return dots.astype(weights.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def encode(x: jax.Array, weights: jax.Array, slots: jax.Array, num_slots: int) -> jax.Array:
    """Scatters tokens into slots by gathering.

    Args:
      x: [S, M] tokens.
      weights: [k, S] weight applied to each assignment.
      slots: [k, S] int32 flat slot of each assignment; a value outside [0, num_slots) means dropped.
      num_slots: number of rows of the output.

    Returns:
      [num_slots, M]; an empty slot holds zeros.
    """
    return _encode_impl(x, weights, slots, num_slots)


def _encode_fwd(x, weights, slots, num_slots):
    return _encode_impl(x, weights, slots, num_slots), (x, weights, slots)


def _encode_bwd(num_slots, res, g):
    x, weights, slots = res
    dx = _decode_impl(g, weights, slots).astype(x.dtype)
    dw = _assignment_dots(x, g, weights, slots)
    return dx, dw, None


encode.defvjp(_encode_fwd, _encode_bwd)


@jax.custom_vjp
def decode(data: jax.Array, weights: jax.Array, slots: jax.Array) -> jax.Array:
    """Combines slot rows back into tokens.

    Args:
      data: [num_slots, M] expert outputs.
      weights: [k, S] combine weights.
      slots: [k, S] int32 flat slots; out-of-range means dropped (contributes zero).

    Returns:
      [S, M], `y[s] = sum_j weights[j, s] * data[slots[j, s]]`.
    """
    return _decode_impl(data, weights, slots)


def _decode_fwd(data, weights, slots):
    return _decode_impl(data, weights, slots), (data, weights, slots)


def _decode_bwd(res, g):
    data, weights, slots = res
    ddata = _encode_impl(g, weights, slots, data.shape[0]).astype(data.dtype)
    dw = _assignment_dots(g, data, weights, slots)
    return ddata, dw, None


decode.defvjp(_decode_fwd, _decode_bwd)


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
    starts = jnp.cumsum(plan.dispatch_count) - plan.dispatch_count
    return (starts[plan.expert_ids] + plan.locations).astype(jnp.int32)


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
    owner = _slot_owner(slots, data.shape[0])
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
    """The pallas_kernels version of an op when `backend` resolves to kernels (`execution.kernels`: the
    platform's kernels by default), else None (this module's XLA version)."""
    backend = execution.kernels(backend)
    if backend is None or top_k >= SLOT_MAJOR_MIN_K:
        return None
    op = getattr(pallas_kernels, name)
    return lambda *args: op(*args, implementation=backend)


def fast_encode(x: jax.Array, plan: RoutingPlan, is_postscore: bool = True, backend: str | None = None
                ) -> jax.Array:
    """Tutel's `fast_encode`: [S, M] tokens -> [E, C, M] expert buffer.

    With `is_postscore` tokens are copied as they are (weights applied at decode); otherwise each is scaled by
    its gate weight. Computed in the gate's dtype, like Tutel; the caller casts back. `backend` selects the
    `pallas_kernels` implementation (see `execution.kernels`: None / 'auto' is the compile platform's kernels,
    'xla' this module's gathers).
    """
    cap = plan.buffer_capacity
    slots = buffer_slots(plan)
    x = x.astype(plan.gates.dtype)
    weights, num_slots = _encode_weights(plan, is_postscore), plan.num_experts * cap
    if plan.top_k >= SLOT_MAJOR_MIN_K:  # gathers per slot; autodiff's transpose is a scatter-add per slot
        flat = _encode_impl(x, weights, slots, num_slots)
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
