"""The grouped matmul's semantics in plain JAX: the reference every backend of gmm / tgmm must equal.

    gmm_reference(lhs[T, K], rhs[G, K, N] (or [G, N, K] with transpose_rhs), group_sizes[G]) -> [T, N]
    tgmm_reference(lhs[T, K], grad[T, N], group_sizes[G]) -> [G, K, N]

Rows of lhs are sorted by group: rows [start_g, start_g + group_sizes[g]) use rhs[g]. Rows past
sum(group_sizes) produce zeros (gmm) and are ignored (tgmm); a group that extends past T is cut at T
(`clamp_group_sizes`); an empty group gives a zero [K, N] block (tgmm). `jax.lax.ragged_dot` (and
`lax.ragged_dot_general` with a ragged contraction for tgmm) is correct but dense-masked on a CPU: the kernels
touch only the tiles a group owns.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["gmm_reference", "tgmm_reference", "clamp_group_sizes"]


def gmm_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool = False,
                  preferred_element_type: Any = None) -> jax.Array:
    """`lax.ragged_dot`; rhs is [G, K, N], or [G, N, K] with transpose_rhs."""
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)
    return lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32), preferred_element_type=preferred_element_type)


def tgmm_reference(lhs: jax.Array, grad: jax.Array, group_sizes: jax.Array, *,
                   preferred_element_type: Any = None) -> jax.Array:
    """[G, K, N]: out[g] = lhs[rows_g].T @ grad[rows_g] (`lax.ragged_dot_general`, ragged contraction)."""
    dims = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                         lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    return lax.ragged_dot_general(lhs, grad, group_sizes.astype(jnp.int32), dims,
                                  preferred_element_type=preferred_element_type)


def clamp_group_sizes(group_sizes: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """(sizes, total): group sizes cut so that no group extends past row `num_rows`, and their sum."""
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), num_rows)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return (ends - starts).astype(jnp.int32), ends[-1]
