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
    """`pl.pallas_call` for the Triton backend: whole-array refs (no BlockSpecs), explicit compiler params."""
    grid = tuple(max(int(g), 1) for g in grid)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )

