"""Quantized matmul's semantics in plain JAX: dequantize with the NumPy-exact dequantizers (formats/), then
multiply in float32 at HIGHEST precision; the reference every backend equals.

    quant_matmul_reference(x[M, K], w[N, K] quantized) -> [M, N] = x @ dequant(w).T
    quant_gmm_reference(x[T, K], w[G, N, K] quantized, group_sizes[G]) -> [T, N]   (rows sorted by group)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["quant_matmul_reference", "quant_gmm_reference"]


def quant_matmul_reference(x: jax.Array, w: Any, *, out_dtype: Any = None) -> jax.Array:
    """x [M, K] @ dequant(w [N, K]).T in float32 (HIGHEST), cast to out_dtype (default x.dtype)."""
    out = jnp.dot(x.astype(jnp.float32), w.dequantize().T, precision=lax.Precision.HIGHEST)
    return out.astype(out_dtype or x.dtype)


def quant_gmm_reference(x: jax.Array, w: Any, group_sizes: jax.Array, *, out_dtype: Any = None) -> jax.Array:
    """`lax.ragged_dot(x, dequant(w).swapaxes(1, 2), group_sizes)` in float32 (HIGHEST)."""
    rhs = jnp.swapaxes(w.dequantize(), 1, 2)
    out = lax.ragged_dot(x.astype(jnp.float32), rhs, group_sizes.astype(jnp.int32),
                         precision=lax.Precision.HIGHEST)
    return out.astype(out_dtype or x.dtype)
