"""Dispatch and combine in plain JAX: index gathers with custom VJPs, the reference every backend equals.

    encode_reference(x[S, M], weights[k, S], slots[k, S], num_slots) -> [num_slots, M]
        out[slot] = weights[j, s] * x[s] for the assignment (j, s) owning the slot, zeros for an empty slot;
        a slot value outside [0, num_slots) means the assignment is dropped.
    decode_reference(data[num_slots, M], weights[k, S], slots[k, S]) -> [S, M]
        y[s] = sum_j weights[j, s] * data[slots[j, s]], summed in choice order in data's dtype (like Tutel);
        dropped assignments add nothing.
    row_dots_reference(a[S, M], b[num_slots, M], slots[k, S]) -> [k, S] float32: <a[s], b[slots[j, s]]>,
        the weight gradients of both.

Both directions are gathers; the custom VJPs make the gradient of each one the other one (plus the row dots for
the weights), so backward is gathers too and never a scatter-add over [E, C, M]. Work is O(k * S * M); no
one-hot [S, E, C] tensor is ever formed. The same pair serves two layouts:
  - the capacity buffer [E, C, M] as the flat [E*C, M]: slot = expert * C + location;
  - the dropless grouped layout [k*S, M], rows sorted by expert: slot = start(expert) + location
    (`grouped_rows`), where every row is owned by exactly one assignment.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

__all__ = ["encode_reference", "decode_reference", "row_dots_reference", "gather_encode", "slot_owner",
           "grouped_rows"]


def slot_owner(slots: jax.Array, num_slots: int) -> jax.Array:
    """[num_slots] int32 index into the flattened [k*S] assignments that fills each slot (k*S when empty)."""
    num_assign = slots.size
    owner = jnp.full((num_slots,), num_assign, jnp.int32)
    return owner.at[slots.reshape(-1)].set(jnp.arange(num_assign, dtype=jnp.int32), mode="drop")


def gather_encode(x: jax.Array, weights: jax.Array, slots: jax.Array, num_slots: int) -> jax.Array:
    """encode without a custom VJP (autodiff's transpose of it is a scatter-add per slot)."""
    k, num_tokens = weights.shape
    owner = slot_owner(slots, num_slots)
    token = jnp.where(owner < k * num_tokens, owner % num_tokens, num_tokens)
    rows = jnp.take(x, token, axis=0, mode="fill", fill_value=0)
    w = jnp.take(weights.reshape(-1), owner, mode="fill", fill_value=0)
    return rows * w[:, None].astype(rows.dtype)


def _gather_decode(data, weights, slots):
    out = None
    for j in range(weights.shape[0]):  # k is small; summing in choice order matches Tutel
        rows = jnp.take(data, slots[j], axis=0, mode="fill", fill_value=0)
        term = rows * weights[j][:, None].astype(rows.dtype)
        out = term if out is None else out + term
    return out


def row_dots_reference(a: jax.Array, b: jax.Array, slots: jax.Array) -> jax.Array:
    """[k, S] float32 <a[s], b[slots[j, s]]>, zero where the slot is out of range (one gather for all k)."""
    k, num_tokens = slots.shape
    rows = jnp.take(b, slots.reshape(-1), axis=0, mode="fill", fill_value=0).reshape(k, num_tokens, -1)
    return jnp.einsum("ksm,sm->ks", rows.astype(jnp.float32), a.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def encode_reference(x: jax.Array, weights: jax.Array, slots: jax.Array, num_slots: int) -> jax.Array:
    """Scatters tokens into slots by gathering.

    Args:
      x: [S, M] tokens.
      weights: [k, S] weight applied to each assignment.
      slots: [k, S] int32 flat slot of each assignment; a value outside [0, num_slots) means dropped. Slots
        must be distinct (a routing plan guarantees it).
      num_slots: number of rows of the output.

    Returns:
      [num_slots, M]; an empty slot holds zeros.
    """
    return gather_encode(x, weights, slots, num_slots)


def _encode_fwd(x, weights, slots, num_slots):
    return gather_encode(x, weights, slots, num_slots), (x, weights, slots)


def _encode_bwd(num_slots, res, g):
    x, weights, slots = res
    dx = _gather_decode(g, weights, slots).astype(x.dtype)
    dw = row_dots_reference(x, g, slots).astype(weights.dtype)
    return dx, dw, None


encode_reference.defvjp(_encode_fwd, _encode_bwd)


@jax.custom_vjp
def decode_reference(data: jax.Array, weights: jax.Array, slots: jax.Array) -> jax.Array:
    """Combines slot rows back into tokens.

    Args:
      data: [num_slots, M] expert outputs.
      weights: [k, S] combine weights.
      slots: [k, S] int32 flat slots; out-of-range means dropped (contributes zero).

    Returns:
      [S, M], `y[s] = sum_j weights[j, s] * data[slots[j, s]]` in data's dtype.
    """
    return _gather_decode(data, weights, slots)


def _decode_fwd(data, weights, slots):
    return _gather_decode(data, weights, slots), (data, weights, slots)


def _decode_bwd(res, g):
    data, weights, slots = res
    ddata = gather_encode(g, weights, slots, data.shape[0]).astype(data.dtype)
    dw = row_dots_reference(g, data, slots).astype(weights.dtype)
    return ddata, dw, None


decode_reference.defvjp(_decode_fwd, _decode_bwd)


def grouped_rows(expert_ids: jax.Array, locations: jax.Array, counts: jax.Array) -> jax.Array:
    """[k, S] row of each assignment in the dropless layout [k*S, M] sorted by expert (group sizes = counts):
    start(expert) + location (Tutel's location within the expert)."""
    starts = jnp.cumsum(counts) - counts
    return (starts[expert_ids] + locations).astype(jnp.int32)
