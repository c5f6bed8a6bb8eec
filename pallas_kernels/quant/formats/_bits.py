"""Bit-level pieces shared by the FP8 and FP4 formats: the E2M1 table, integer-op decoders, nibble packing.

The decoders (`e2m1_to_f32`, `e8m0_to_f32`, `e4m3_to_f32`) build float32 bit patterns with integer ops, so the
same code runs in Triton, in Mosaic, in Pallas' interpreter and in XLA, with no lookup table and no float4 type;
`e4m3_to_f32` is how kernels read FP8 on GPUs without e4m3 conversion instructions (A100).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["E2M1_LUT", "FP8_MAX", "e2m1_to_f32", "e8m0_to_f32", "e4m3_to_f32", "unpack_fp4", "pack_fp4",
           "nearest_e2m1", "to_e4m3", "nibbles_numpy", "lut"]

#: E2M1 code -> value; the LOW nibble of a byte is the EVEN element
E2M1_LUT = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def e2m1_to_f32(code: jax.Array) -> jax.Array:
    """E2M1 codes (any int dtype, values 0..15) -> float32, exactly `E2M1_LUT[code]`.

    code = s e1 e0 m: exponent field e > 0 gives (1 + m/2) * 2**(e - 1), i.e. float32 bits
    s << 31 | (e + 126) << 23 | m << 22; e == 0 gives m * 0.5 (0.5 is 0x3F000000).
    """
    code = code.astype(jnp.int32)
    sign = (code >> 3) & 1
    exp = (code >> 1) & 3
    man = code & 1
    normal = ((exp + 126) << 23) | (man << 22)
    subnormal = jnp.where(man == 1, 0x3F000000, 0)
    bits = (sign << 31) | jnp.where(exp == 0, subnormal, normal)
    return lax.bitcast_convert_type(bits, jnp.float32)


def e8m0_to_f32(scale: jax.Array) -> jax.Array:
    """Unsigned E8M0 exponents (uint8) -> float32 2**(s - 127), exactly `np.float32(2.0 ** (s - 127))`.

    s in 1..254 is the float32 with exponent field s; s = 0 is 2**-127 (a float32 subnormal, bits 0x00400000);
    s = 255 overflows float32 to inf (as NumPy's cast of 2**128 does).
    """
    s = scale.astype(jnp.int32)
    bits = jnp.where(s == 0, 0x00400000, s << 23)
    return lax.bitcast_convert_type(bits, jnp.float32)


def e4m3_to_f32(bits: jax.Array) -> jax.Array:
    """float8_e4m3fn bit patterns (uint8 or any int dtype, 0..255) -> float32, exactly
    `bits.view(float8_e4m3fn).astype(float32)`, with integer operations only (A100 has no e4m3 conversion).

    bits = s eeee mmm: e > 0 is (1 + m/8) * 2**(e - 7), i.e. float32 bits s << 31 | (e + 120) << 23 | m << 20;
    e == 0 is the subnormal m * 2**-9 (exact in float32); 0x7F and 0xFF are NaN (e4m3fn has no infinity).
    """
    b = bits.astype(jnp.int32)
    sign = (b >> 7) & 1
    exp = (b >> 3) & 15
    man = b & 7
    normal = lax.bitcast_convert_type((sign << 31) | ((exp + 120) << 23) | (man << 20), jnp.float32)
    magnitude = man.astype(jnp.float32) * jnp.float32(2.0 ** -9)
    subnormal = jnp.where(sign == 1, -magnitude, magnitude)
    value = jnp.where(exp == 0, subnormal, normal)
    return jnp.where((b & 0x7F) == 0x7F, jnp.float32(jnp.nan), value)


def unpack_fp4(packed: jax.Array) -> jax.Array:
    """uint8 [..., n] -> E2M1 codes int32 [..., 2n], the low nibble first (the even element)."""
    p = packed.astype(jnp.int32)
    codes = jnp.stack([p & 0xF, p >> 4], axis=-1)
    return codes.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def pack_fp4(codes: jax.Array) -> jax.Array:
    """int codes [..., 2n] -> uint8 [..., n], the even element in the low nibble."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(jnp.uint8)


def lut(codes: jax.Array) -> jax.Array:
    """E2M1 codes -> float32 values by table (the reference dequantizers' reading)."""
    return jnp.asarray(E2M1_LUT)[codes]


def nearest_e2m1(x: jax.Array) -> jax.Array:
    """float32 -> E2M1 code of the nearest representable value (ties to the lower code)."""
    table = jnp.asarray(E2M1_LUT[:8])
    code = jnp.argmin(jnp.abs(jnp.abs(x)[..., None] - table), axis=-1).astype(jnp.int32)
    return jnp.where((x < 0) & (code > 0), code | 8, code)


def to_e4m3(x: jax.Array) -> jax.Array:
    """float -> float8_e4m3fn, saturating (astype alone turns 1000 into NaN)."""
    return jnp.clip(x, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)


def nibbles_numpy(packed: np.ndarray) -> np.ndarray:
    """NumPy: uint8 [..., n] -> codes [..., 2n], low nibble first."""
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (-1,))
