"""Pieces the formats' Mosaic TPU tile code shares (each format's operands and accumulation live in its module;
`quant/_pallas_mosaic_tpu.py` runs the schedule). Layouts: the module docstring of `pallas_mosaic_tpu.py`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ._bits import e2m1_to_f32

__all__ = ["CHUNK_K", "round_up", "dot_nt", "repeat_lanes", "rows_spec", "weight_spec", "fp4_operands",
           "fp4_accumulate", "fp4_vmem"]

#: K columns dequantized per step of the in-kernel K loop (FP4 formats; FP8 goes by its 128-column blocks)
CHUNK_K = 512


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def dot_nt(a: jax.Array, b: jax.Array, precision: Any) -> jax.Array:
    """a [m, c] . b [n, c] -> [m, n] float32 (b transposed on the MXU, no copy)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                           precision=precision)


def repeat_lanes(s: jax.Array, times: int) -> jax.Array:
    """[r, c] -> [r, c * times] float32, each column repeated `times` times (one scale over its block of
    columns), as a dot with a 0/1 expansion matrix: the MXU does the lane broadcast, which Mosaic would
    otherwise build with costly lane shuffles. Exact for scales exact in bfloat16 (powers of two, e4m3)."""
    r, c = s.shape
    src = lax.broadcasted_iota(jnp.int32, (c, c * times), 0)
    dst = lax.broadcasted_iota(jnp.int32, (c, c * times), 1)
    expand = (dst // times == src).astype(jnp.bfloat16)
    return lax.dot_general(s.astype(jnp.bfloat16), expand, (((1,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32)


def rows_spec(tm: int, cols: int) -> pl.BlockSpec:
    """The item's row tile of an activation operand [T, cols]."""
    return pl.BlockSpec((tm, cols), lambda n, i, g, wg, t, *_: (t[i], 0))


def weight_spec(block: tuple[int, int], n_axis: int) -> pl.BlockSpec:
    """The item's expert's block of a weight operand [G, a, b]; the N tile moves along `n_axis` (1 or 2)."""
    if n_axis == 1:
        return pl.BlockSpec((None, *block), lambda n, i, g, wg, *_: (wg[i], n, 0))
    return pl.BlockSpec((None, *block), lambda n, i, g, wg, *_: (wg[i], 0, n))


def fp4_operands(x: jax.Array, packed: jax.Array, scales: jax.Array, tm: int, tn: int, k_dim: int
                 ) -> tuple[tuple, tuple, list]:
    """FP4 operands: x's even and odd columns (the low nibble of byte j is column 2j, the high one 2j + 1),
    packed bytes [G, N, K/2] and the block scales [G, N, K/block]."""
    acts = (x[:, 0::2], x[:, 1::2])
    specs = [rows_spec(tm, k_dim // 2), rows_spec(tm, k_dim // 2), weight_spec((tn, k_dim // 2), 1),
             weight_spec((tn, scales.shape[-1]), 1)]
    return acts, (packed, scales), specs


def fp4_accumulate(refs, *, tm: int, tn: int, k_dim: int, compute_dtype: Any, precision: Any, per_scale: int,
                   scale_values: Callable[[Any], jax.Array]) -> jax.Array:
    """sum over K chunks of x_even . (lo nibble values).T + x_odd . (hi nibble values).T: [tm, tn] float32.
    `scale_values(s_ref)` gives the float32 scale of every `per_scale` columns, [tn, K / per_scale]."""
    xe_ref, xo_ref, p_ref, s_ref = refs[:4]
    scales = scale_values(s_ref)
    half = k_dim // 2
    per_byte = per_scale // 2  # packed bytes under one scale
    acc = jnp.zeros((tm, tn), jnp.float32)
    for c0 in range(0, half, CHUNK_K // 2):
        c1 = min(c0 + CHUNK_K // 2, half)
        codes = p_ref[:, c0:c1].astype(jnp.int32)
        scale = repeat_lanes(scales[:, c0 // per_byte:c1 // per_byte], per_byte)
        lo = (e2m1_to_f32(codes & 0xF) * scale).astype(compute_dtype)  # exact in bf16 (nibble x scale)
        hi = (e2m1_to_f32(codes >> 4) * scale).astype(compute_dtype)
        acc = acc + dot_nt(xe_ref[:, c0:c1].astype(compute_dtype), lo, precision)
        acc = acc + dot_nt(xo_ref[:, c0:c1].astype(compute_dtype), hi, precision)
    return acc


def fp4_vmem(per_scale: int, tn: int, k_dim: int) -> tuple[int, int, int]:
    """(weight, scale, temporaries) bytes of an FP4 format's blocks: packed bytes and byte scales (sublanes
    padded to 32, lanes to 128), the scale rows as float32 and one chunk's codes / values / repeated scales."""
    tn_bytes = round_up(tn, 32)
    weight = tn_bytes * round_up(k_dim // 2, 128)
    scale = tn_bytes * round_up(k_dim // per_scale, 128)
    temps = tn * round_up(k_dim // per_scale, 128) * 4 + 8 * tn * (CHUNK_K // 2) * 4
    return weight, scale, temps
