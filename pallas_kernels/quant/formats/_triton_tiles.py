"""Pieces the formats' Pallas Triton weight-tile loaders share (the loaders themselves live in their format's
module; `quant/_pallas_triton.py` runs them inside the grouped-matmul kernel).

A loader has `num_refs`, `transposed`, `check_block_k(block_k)`, `tile(refs, g, k0, ks, ns, kmask, nmask,
compute_dtype) -> [bn, bk]`, `step_scale(...)` (a per-column factor of one K step's partial product, or None)
and `final_scale(refs, g)` (a per-group factor of the accumulator, or None).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plt

from ._bits import e2m1_to_f32, e4m3_to_f32

__all__ = ["expand", "fp4_tile", "e4m3_load", "fp8_operand"]


def _fp8_zero() -> jax.Array:
    """An e4m3 zero for masked loads (Triton cannot cast the integer literal 0 to fp8)."""
    return jnp.zeros((), jnp.float8_e4m3fn)


def expand(scale: jax.Array, bn: int, groups: int, per: int) -> jax.Array:
    """[bn, groups] -> [bn, groups * per]: each group scale repeated over its `per` packed bytes."""
    return jnp.broadcast_to(scale[:, :, None], (bn, groups, per)).reshape(bn, groups * per)


def fp4_tile(packed: jax.Array, scale: jax.Array) -> jax.Array:
    """uint8 [bn, bk/2] and a float32 scale per byte [bn, bk/2] -> float32 [bn, bk], the low nibble first."""
    lo = e2m1_to_f32(packed & 0xF) * scale
    hi = e2m1_to_f32(packed >> 4) * scale
    bn, half = packed.shape
    return jnp.stack([lo, hi], axis=-1).reshape(bn, 2 * half)


def e4m3_load(ref, index, mask, fp8_bits: bool) -> jax.Array:
    """A masked load of e4m3 values as float32: a hardware conversion, or (fp8_bits) the ref holds the e4m3 bit
    patterns as uint8 and integer operations decode them (`e4m3_to_f32`: targets without e4m3 instructions)."""
    if fp8_bits:
        return e4m3_to_f32(plt.load(ref.at[index], mask=mask, other=0))
    return plt.load(ref.at[index], mask=mask, other=_fp8_zero()).astype(jnp.float32)


def fp8_operand(a: jax.Array, fp8_bits: bool) -> jax.Array:
    """e4m3 kernel operands travel as their uint8 bit patterns when the kernel decodes them with integer ops."""
    return lax.bitcast_convert_type(a, jnp.uint8) if fp8_bits else a
