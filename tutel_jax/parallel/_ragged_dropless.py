"""Dropless expert parallelism with `lax.ragged_all_to_all`: no per-expert padding on the wire.

Inside `shard_map`, on each of the W devices of the (flat) expert axes, with n = E / W local experts:
  1. permute the k*S local assignments into rows sorted by global expert (so by destination device);
  2. all_gather the per-expert counts [W, E]: every device then knows every slice size and offset;
  3. ragged_all_to_all the rows: device j receives, source by source, the rows for its n experts into a static
     buffer of R rows (source-major, each source's rows sorted by local expert);
  4. regroup them expert-major (a gather), run `experts.grouped` (ragged_dot), regroup back (a gather);
  5. ragged_all_to_all the outputs back to their sources, and unpermute.
Gradients: gathers transpose to scatter-adds; `ragged_all_to_all` has JAX's own JVP and transpose rules.

Bound: R = `recv_capacity` rows per device (default 2 x k x S_local, twice the balanced load). Every device can
compute every receive size from the gathered counts, so they all agree whether some device would receive more
than R rows; when one would, the call runs the padded all_to_all path instead (`fallback`), which never drops.

Backends: XLA:CPU cannot compile `ragged_all_to_all` (it lowers, but compilation fails). `ragged_supported()`
says whether the default backend can (GPU, TPU). On CPU the exchange can be emulated exactly with a padded
all_to_all (`emulated_ragged_all_to_all`, W x the memory) to test this module's offsets and regrouping.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from .. import core, routing
from ..routing import RoutingPlan
from ..core import varying
from ._all_to_all import axis_size

__all__ = ["ragged_supported", "emulated_ragged_all_to_all", "default_recv_capacity", "ragged_dropless_experts"]


def ragged_supported(backend: str | None = None) -> bool:
    """True where `lax.ragged_all_to_all` compiles (GPU, TPU): `backend`, else the platform the program is
    compiled for; False on CPU."""
    return (backend or core.platform()) in ("gpu", "cuda", "rocm", "tpu")


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """`lax.ragged_all_to_all`'s documented semantics (one slice per device) with a padded all_to_all.

    Each device sends W blocks of operand.shape[0] rows (zeros past each slice), so it costs W times the memory
    of the real collective: a CPU stand-in for tests, not a fast path."""
    rows = operand.shape[0]
    r = jnp.arange(rows, dtype=jnp.int32)
    idx = input_offsets[:, None] + r[None, :]
    keep = r[None, :] < send_sizes[:, None]
    blocks = jnp.take(operand, jnp.where(keep, idx, rows), axis=0, mode="fill", fill_value=0)  # [W, rows, ...]
    received = lax.all_to_all(blocks, axis_name, 0, 0, tiled=True)
    offsets = lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    dest = jnp.where(r[None, :] < recv_sizes[:, None], offsets[:, None] + r[None, :], output.shape[0])
    flat = received.reshape((-1,) + operand.shape[1:])
    return output.at[dest.reshape(-1)].set(flat, mode="drop")


def default_recv_capacity(num_tokens: int, top_k: int, factor: float = 2.0) -> int:
    """R = ceil(factor * k * S_local) rows, at least 1."""
    return max(1, math.ceil(factor * top_k * num_tokens))


def _exclusive_cumsum(v, axis=0):
    return jnp.cumsum(v, axis=axis) - v


def _varying_zeros(shape, dtype, axis):
    """Zeros typed as varying over `axis` (shard_map's check_vma): ragged_all_to_all's result takes the type of
    its `output` buffer, and the custom VJPs downstream need it to match their varying cotangents."""
    return varying(jnp.zeros(shape, dtype), axis)


def ragged_dropless_experts(
    tokens: jax.Array,
    plan: RoutingPlan,
    expert_params: Any,
    experts: Any,
    axes: str | Sequence[str],
    *,
    is_postscore: bool = True,
    recv_capacity: int | None = None,
    fallback: Callable[[], jax.Array] | None = None,
    exchange: Callable[..., jax.Array] = lax.ragged_all_to_all,
) -> jax.Array:
    """The routed experts' output for this device's tokens [S, M] -> [S, M_out]; call inside shard_map.

    Args:
      tokens: [S, M] this device's tokens.
      plan: this device's dropless plan (buffer_capacity None); `plan.num_experts` = E = n * W.
      expert_params: this device's n experts' parameters.
      experts: the expert network (needs `grouped`).
      axes: the expert mesh axes (flat; W devices).
      is_postscore: where the gate weights are applied (as in the rest of the layer).
      recv_capacity: R, the static receive buffer in rows (default `default_recv_capacity`).
      fallback: run instead when some device would receive more than R rows (e.g. the padded path);
        None: no check, so the caller must size R for the worst case W * k * S_local.
      exchange: `lax.ragged_all_to_all`, or `emulated_ragged_all_to_all` on CPU.
    """
    if not experts.supports("grouped"):
        raise ValueError(f"ragged dropless expert parallelism needs experts with grouped(); "
                         f"{experts.type_name} has none")
    num_tokens = tokens.shape[0]
    world = axis_size(axes)
    num_experts = plan.num_experts
    n = num_experts // world
    recv_capacity = default_recv_capacity(num_tokens, plan.top_k) if recv_capacity is None else int(recv_capacity)
    axis = axes if isinstance(axes, str) else tuple(axes)
    me = lax.axis_index(axis)

    all_counts = lax.all_gather(plan.dispatch_count, axis)  # [W, E] counts of every source device
    sizes = all_counts.reshape(world, world, n).sum(-1)  # sizes[s, j]: rows source s sends to device j
    send_sizes = sizes[me]
    input_offsets = _exclusive_cumsum(send_sizes)
    output_offsets = _exclusive_cumsum(sizes, axis=0)[me]  # where my slice starts on each receiver
    recv_sizes = sizes[:, me]
    recv_offsets = _exclusive_cumsum(recv_sizes)
    overflow = jnp.max(jnp.sum(sizes, axis=0)) > recv_capacity  # the same value on every device

    def ragged():
        rows = routing.permute(tokens, plan, is_postscore).astype(tokens.dtype)  # [k*S, M] by global expert
        buf = _varying_zeros((recv_capacity,) + rows.shape[1:], rows.dtype, axis)
        received = exchange(rows, buf, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis)
        # regroup (source, local expert) -> (local expert, source)
        mine = lax.dynamic_slice_in_dim(all_counts, me * n, n, axis=1)  # [W, n]
        group_sizes = jnp.sum(mine, axis=0)
        src_start = (recv_offsets[:, None] + _exclusive_cumsum(mine, axis=1)).T.reshape(-1)  # expert-major
        dst_start = (_exclusive_cumsum(group_sizes)[None, :] + _exclusive_cumsum(mine, axis=0)).T.reshape(-1)
        r = jnp.arange(recv_capacity, dtype=jnp.int32)
        block = jnp.clip(jnp.searchsorted(dst_start, r, side="right") - 1, 0, dst_start.shape[0] - 1)
        src = jnp.where(r < jnp.sum(group_sizes), src_start[block] + r - dst_start[block], recv_capacity)
        local_rows = jnp.take(received, src, axis=0, mode="fill", fill_value=0)
        out = experts.grouped(expert_params, local_rows, group_sizes)  # [R, M_out]
        back_index = jnp.full((recv_capacity,), recv_capacity, jnp.int32).at[src].set(r, mode="drop")
        back = jnp.take(out, back_index, axis=0, mode="fill", fill_value=0)  # source-major again
        returned = exchange(back, _varying_zeros((rows.shape[0],) + out.shape[1:], out.dtype, axis), recv_offsets,
                            recv_sizes, _exclusive_cumsum(sizes, axis=1)[:, me], send_sizes, axis_name=axis)
        return routing.unpermute(returned, plan, is_postscore)

    if fallback is None:
        return ragged()
    return lax.cond(overflow, fallback, ragged)
