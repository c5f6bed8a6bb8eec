"""Kernels that XLA cannot partition, run inside `shard_map` (Mosaic TPU and Mosaic GPU kernels).

XLA's SPMD partitioner does not split a Mosaic custom call: on a multi-device mesh such a kernel runs inside
`shard_map`, one call per device, with every mesh axis of size > 1 manual (`require_manual_axes` says
NotSupported otherwise, and "auto" then takes the XLA reference). Inside `shard_map` with `check_vma` on, a
pallas_call's outputs carry no manual-axis types: `run_manual` traces it with the check off and types its outputs
as varying over every axis an operand varies over, and `sum_to_primal_vma` gives a custom VJP's cotangent the
type of its primal (the transpose of an implicit broadcast is a psum).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable

import jax

from ._select import NotSupported

__all__ = ["require_manual_axes", "run_manual", "sum_to_primal_vma"]


def _auto_partitioned_axes() -> tuple[str, ...]:
    """Mesh axes of size > 1 in context that are not manual (XLA would have to partition a kernel over them)."""
    try:
        mesh = jax.sharding.get_abstract_mesh()
    except Exception:  # noqa: BLE001 - a JAX without abstract meshes: nothing to partition
        return ()
    if mesh is None or getattr(mesh, "empty", True):
        return ()
    manual = set(getattr(mesh, "manual_axes", ()) or ())
    return tuple(name for name, size in zip(mesh.axis_names, mesh.axis_sizes) if size > 1 and name not in manual)


def require_manual_axes(kind: str = "Mosaic") -> None:
    """NotSupported when a mesh axis of size > 1 in context is not manual: XLA cannot partition `kind` kernels,
    which therefore run inside `shard_map` (one call per device)."""
    axes = _auto_partitioned_axes()
    if axes:
        raise NotSupported(f"{kind} kernels cannot be partitioned automatically (mesh axes {axes} are not "
                           "manual); call the op inside shard_map")


def _vma_check_off():
    config = getattr(importlib.import_module("jax._src.config"), "_check_vma", None)
    return config(False) if config is not None else contextlib.nullcontext()


def run_manual(fn: Callable[..., Any], *operands: Any) -> Any:
    """`fn(*operands)` for a pallas_call-based `fn` that does not type its outputs for `shard_map`'s check_vma.

    Outside shard_map (no operand varies over a mesh axis) this is `fn(*operands)`. Inside, `fn` is traced with
    the check off and its outputs are declared varying over the union of the operands' varying axes.
    """
    types = [getattr(jax.typeof(o), "manual_axis_type", None) for o in operands]
    axes: frozenset = frozenset()
    if types and all(t is not None for t in types):
        axes = frozenset().union(*(t.varying for t in types))
    if not axes:
        return fn(*operands)
    with _vma_check_off():
        out = fn(*operands)
    cast = getattr(jax.lax, "pcast", None)

    def vary(x):
        have = getattr(getattr(jax.typeof(x), "manual_axis_type", None), "varying", frozenset())
        missing = tuple(sorted(axes - frozenset(have)))
        if not missing:
            return x
        return cast(x, missing, to="varying") if cast is not None else jax.lax.pvary(x, missing)

    return jax.tree_util.tree_map(vary, out)


def sum_to_primal_vma(cotangent: jax.Array, primal: jax.Array) -> jax.Array:
    """A custom VJP's cotangent for `primal`, summed (psum) over the mesh axes it varies over but `primal` does
    not: inside shard_map, an invariant input (replicated expert weights) used with varying ones is implicitly
    broadcast, whose transpose is that sum. Outside shard_map, or where the types already agree, unchanged."""
    have = getattr(jax.typeof(cotangent), "manual_axis_type", None)
    want = getattr(jax.typeof(primal), "manual_axis_type", None)
    if have is None or want is None:
        return cotangent
    extra = tuple(sorted(frozenset(have.varying) - frozenset(want.varying)))
    return jax.lax.psum(cotangent, extra) if extra else cotangent
