"""Small helpers shared by the kernels: sizes, index grids, the Triton `pallas_call` wrapper.

Two Pallas facts shape every kernel here:
- Triton tensors have power-of-two shapes, so blocks are powers of two and every load/store of a partial block
  is masked; we never rely on BlockSpec padding (out-of-bounds block reads are undefined on the GPU).
- Pallas' interpreter (our CPU test path) accepts an indexer made only of integer arrays/scalars (a gather) or
  only of slices, not a mix. All kernels therefore index refs with broadcast integer arrays (`rows[:, None]`,
  `cols[None, :]`), which Triton lowers to one pointer tensor and the interpreter to one gather.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

__all__ = ["cdiv", "next_pow2", "is_pow2", "check_pow2", "triton_call", "col", "row"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def check_pow2(name: str, value: int, minimum: int = 1) -> None:
    """Config validation: Triton block dims must be powers of two (and >= 16 for the dims of a dot)."""
    if not isinstance(value, int) or isinstance(value, bool) or not is_pow2(value) or value < minimum:
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value!r}")


def row(v: jax.Array) -> jax.Array:
    """[n] -> [n, 1]: a vector of row indices broadcast against columns."""
    return v[:, None]


def col(v: jax.Array) -> jax.Array:
    """[n] -> [1, n]."""
    return v[None, :]


def _varying_over_operands(out_shape: Any, operands: Sequence[Any]) -> tuple[Any, list[Any]]:
    """Inside `shard_map` (check_vma), a kernel's outputs need a manual-axis type: the outputs vary over every
    mesh axis an operand varies over, and the invariant operands are cast to varying over those axes too (one
    type for all). Outside shard_map every type is empty and nothing changes."""
    types = [getattr(jax.typeof(o), "manual_axis_type", None) for o in operands]
    if not types or any(t is None for t in types):  # a JAX without manual-axis types on avals
        return out_shape, list(operands)
    axes = frozenset().union(*(t.varying for t in types))
    if axes:
        cast = getattr(jax.lax, "pcast", None)
        operands = [o if axes <= t.varying else
                    (cast(o, tuple(sorted(axes - t.varying)), to="varying") if cast is not None
                     else jax.lax.pvary(o, tuple(sorted(axes - t.varying))))
                    for o, t in zip(operands, types)]
    mat = type(types[0])(varying=axes)
    typed = jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat), out_shape)
    return typed, list(operands)


def triton_call(
    kernel: Callable[..., None],
    *,
    out_shape: Any,
    grid: Sequence[int],
    num_warps: int,
    num_stages: int,
    interpret: bool,
    name: str,
) -> Callable[..., Any]:
    """`pl.pallas_call` for the Triton backend: whole-array refs (no BlockSpecs), explicit compiler params.

    The returned function takes the operands; inside `shard_map` the outputs get the operands' varying mesh
    axes (`_varying_over_operands`), so the kernels run in expert-parallel layers with `check_vma` on."""
    grid = tuple(max(int(g), 1) for g in grid)

    def call(*operands):
        typed_out_shape, operands = _varying_over_operands(out_shape, operands)
        return pl.pallas_call(
            kernel,
            out_shape=typed_out_shape,
            grid=grid,
            compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            interpret=interpret,
            name=name,
        )(*operands)

    return call

