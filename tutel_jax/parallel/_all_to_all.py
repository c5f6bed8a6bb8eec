"""Expert all_to_all inside `shard_map`: flat, and 2-D hierarchical (2DH) over a (node, local) pair of axes.

Layout (Tutel's): before, every rank holds [E, C, M] with E = W * n (rank w owns experts w*n .. w*n+n-1);
after the forward exchange, rank w holds [n, W * C, M] for its own experts, capacity source-rank-major.
The reverse exchange restores [E, C, M]. Both variants move the same bytes to the same places, so they agree
bit for bit; 2DH sends fewer, larger messages across nodes, which pays off only at large scale.
"""

from __future__ import annotations

from typing import Sequence

import jax
from jax import lax

__all__ = ["expert_all_to_all", "expert_all_to_all_reverse", "axis_size"]


def axis_size(axes: str | Sequence[str]) -> int:
    """Size of one or several mesh axes, from inside shard_map."""
    if isinstance(axes, str):
        return lax.axis_size(axes)
    size = 1
    for a in axes:
        size *= lax.axis_size(a)
    return size


def _flat_forward(buf, axes):
    return lax.all_to_all(buf, axes, split_axis=0, concat_axis=1, tiled=True)


def _flat_reverse(buf, axes):
    return lax.all_to_all(buf, axes, split_axis=1, concat_axis=0, tiled=True)


def _2dh_forward(buf, node_axis, local_axis):
    num_experts, cap, dim = buf.shape
    nodes, locals_ = lax.axis_size(node_axis), lax.axis_size(local_axis)
    n = num_experts // (nodes * locals_)
    x = buf.reshape(nodes, locals_, n, cap, dim)
    x = lax.all_to_all(x, node_axis, split_axis=0, concat_axis=0)   # [node_src, L, n, C, M]
    x = lax.all_to_all(x, local_axis, split_axis=1, concat_axis=1)  # [node_src, local_src, n, C, M]
    x = x.transpose(2, 0, 1, 3, 4)                                  # [n, node_src, local_src, C, M]
    return x.reshape(n, nodes * locals_ * cap, dim)


def _2dh_reverse(buf, node_axis, local_axis):
    n, wc, dim = buf.shape
    nodes, locals_ = lax.axis_size(node_axis), lax.axis_size(local_axis)
    cap = wc // (nodes * locals_)
    x = buf.reshape(n, nodes, locals_, cap, dim).transpose(1, 2, 0, 3, 4)  # [node_dst, local_dst, n, C, M]
    x = lax.all_to_all(x, local_axis, split_axis=1, concat_axis=1)
    x = lax.all_to_all(x, node_axis, split_axis=0, concat_axis=0)
    return x.reshape(nodes * locals_ * n, cap, dim)


def expert_all_to_all(buf: jax.Array, axes: str | Sequence[str], use_2dh: bool = False) -> jax.Array:
    """[E, C, M] per rank -> [E / W, W * C, M] per rank (W = size of `axes`).

    With `use_2dh`, `axes` must be a (node, local) pair of mesh axes; the rank order is node-major.
    """
    if use_2dh:
        if isinstance(axes, str) or len(axes) != 2:
            raise ValueError(f"use_2dh needs a (node, local) pair of mesh axes, got {axes!r}")
        return _2dh_forward(buf, *axes)
    return _flat_forward(buf, axes if isinstance(axes, str) else tuple(axes))


def expert_all_to_all_reverse(buf: jax.Array, axes: str | Sequence[str], use_2dh: bool = False) -> jax.Array:
    """[E / W, W * C, M] per rank -> [E, C, M] per rank; the inverse of `expert_all_to_all`."""
    if use_2dh:
        if isinstance(axes, str) or len(axes) != 2:
            raise ValueError(f"use_2dh needs a (node, local) pair of mesh axes, got {axes!r}")
        return _2dh_reverse(buf, *axes)
    return _flat_reverse(buf, axes if isinstance(axes, str) else tuple(axes))
