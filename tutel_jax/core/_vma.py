"""Varying manual axes (shard_map's `check_vma` types): matching a value's type to the values it meets.

Inside `shard_map`, an array either varies over a mesh axis (a different value per device) or is invariant
over it. Loop carries and custom-VJP inputs must have the type of what is computed from them, so code that mixes
replicated tokens with per-device experts casts the replicated side explicitly (its transpose, a psum, then
happens outside the loop or custom VJP). Outside shard_map these are no-ops.
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["varying", "varying_axes", "varying_like", "summed_like"]


def varying_axes(a: Any) -> set:
    """The mesh axes `a` varies over (empty outside shard_map; the type's field is named differently across
    JAX versions)."""
    t = jax.typeof(a)
    manual = getattr(t, "manual_axis_type", None)
    return set(manual.varying) if manual is not None else set(getattr(t, "vma", ()))


def varying(a: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """`a` (invariant over `axes`) typed as varying over them, inside shard_map."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(a, axes, to="varying")
    return jax.lax.pvary(a, axes)  # older JAX


def varying_like(x: Any, *refs: Any) -> Any:
    """x (a pytree) typed as varying over every mesh axis any leaf of `refs` varies over."""
    axes = set()
    for leaf in jax.tree_util.tree_leaves(refs):
        axes |= varying_axes(leaf)
    if not axes:
        return x

    def cast(a):
        missing = tuple(sorted(axes - varying_axes(a)))
        return varying(a, missing) if missing else a

    return jax.tree_util.tree_map(cast, x)


def summed_like(ct: Any, primal: Any) -> Any:
    """A custom-VJP cotangent `ct` (a pytree) given the type of its `primal` (same structure; None leaves pass):
    summed over the mesh axes it varies over and the primal does not. That is the transpose of the implicit
    cast of an invariant primal to varying (each device's part of the gradient of one shared value)."""

    def cast(c, p):
        if c is None:
            return None
        extra = tuple(sorted(varying_axes(c) - varying_axes(p)))
        return jax.lax.psum(c, extra) if extra else c

    return jax.tree_util.tree_map(cast, ct, primal, is_leaf=lambda a: a is None)
