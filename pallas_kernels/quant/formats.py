"""Quantized weight formats: containers, reference dequantizers, test quantizers, in-kernel decoders.

Formats as the checkpoints store them (see also tests/fixtures/README.md). A weight is stored [out, in]
(HF layout: y = x @ W.T), optionally with leading expert dims [..., out, in].

| container      | element                                   | scale                                            | dequant                          |
|----------------|-------------------------------------------|--------------------------------------------------|----------------------------------|
| Fp8BlockWeight | float8_e4m3fn weight [.., out, in]        | float32 scale_inv [.., ceil(out/128), ceil(in/128)] | w * scale_inv (a multiplier)  |
| Mxfp4Weight    | uint8 blocks [.., out, in/32, 16] (E2M1)  | uint8 E8M0 scales [.., out, in/32], UNSIGNED     | LUT[nibble] * 2**(s - 127)       |
| Nvfp4Weight    | uint8 packed [.., out, in/2] (E2M1)       | e4m3 scale [.., out, in/16], f32 global [.., 1]  | LUT[nibble] * (scale / global)   |

E2M1 LUT = [0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, -1, -1.5, -2, -3, -4, -6]; the LOW nibble of a byte is the
EVEN element. NVFP4 is compressed-tensors' convention: the global scale DIVIDES (ModelOpt's `weight_scale_2`
multiplies: pass its reciprocal only if exactness does not matter, or dequantize with the reference).

The reference dequantizers are float32 and bit-identical to the NumPy formulas of the fixtures README (the tests
compare them with a NumPy implementation). The in-kernel decoders (`e2m1_to_f32`, `e8m0_to_f32`, `e4m3_to_f32`)
build float32 bit patterns with integer ops, so the same code runs in Triton, in Pallas' interpreter and in XLA,
with no lookup table and no float4 type (which the H200 cannot compute with anyway); `e4m3_to_f32` is how
kernels read FP8 on GPUs without e4m3 conversion instructions (A100, `Target.fp8_convert`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["E2M1_LUT", "FP8_MAX", "Fp8BlockWeight", "Mxfp4Weight", "Nvfp4Weight", "QuantizedWeight",
           "dequant_fp8_block", "dequant_mxfp4", "dequant_nvfp4", "quantize_fp8_block", "quantize_mxfp4",
           "quantize_nvfp4", "e2m1_to_f32", "e8m0_to_f32", "e4m3_to_f32", "unpack_fp4"]

E2M1_LUT = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_BLOCK = 128
MXFP4_BLOCK = 32
NVFP4_BLOCK = 16


# ------------------------------------------------------------------------------------------- bit decoders


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


# ------------------------------------------------------------------------------------ reference dequant


def _lut(codes: jax.Array) -> jax.Array:
    return jnp.asarray(E2M1_LUT)[codes]


def dequant_fp8_block(weight: jax.Array, scale_inv: jax.Array, block_size: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)
                      ) -> jax.Array:
    """FP8 block-wise (DeepSeek-V3): float32(weight[.., o, i]) * scale_inv[.., o // 128, i // 128].

    Edge blocks are partial (the scale grid is ceil-sized)."""
    out_dim, in_dim = weight.shape[-2:]
    bo, bi = block_size
    scale = jnp.repeat(jnp.repeat(scale_inv.astype(jnp.float32), bo, axis=-2), bi, axis=-1)
    return weight.astype(jnp.float32) * scale[..., :out_dim, :in_dim]


def dequant_mxfp4(blocks: jax.Array, scales: jax.Array) -> jax.Array:
    """MXFP4 (GPT-OSS): blocks uint8 [.., out, in/32, 16], scales uint8 [.., out, in/32] -> float32 [.., out, in].

    W[.., o, 32g + 2j] = LUT[b & 15] * 2**(s - 127), W[.., o, 32g + 2j + 1] = LUT[b >> 4] * 2**(s - 127)."""
    values = _lut(unpack_fp4(blocks))  # [.., out, in/32, 32]
    values = values * e8m0_to_f32(scales)[..., None]
    return values.reshape(*values.shape[:-2], values.shape[-2] * values.shape[-1])


def dequant_nvfp4(packed: jax.Array, scale: jax.Array, global_scale: jax.Array, global_multiplies: bool = False
                  ) -> jax.Array:
    """NVFP4 (compressed-tensors): packed uint8 [.., out, in/2], scale e4m3 [.., out, in/16], global_scale float32
    [1] (or [.., 1] per expert) -> float32 [.., out, in] = LUT[code] * (float32(scale) / global_scale).
    `global_multiplies` (ModelOpt's `weight_scale_2`): LUT[code] * (float32(scale) * global_scale)."""
    values = _lut(unpack_fp4(packed))  # [.., out, in]
    if global_multiplies:
        factor = jnp.broadcast_to(global_scale.astype(jnp.float32)[..., None], scale.shape)
        return values * jnp.repeat(scale.astype(jnp.float32) * factor, NVFP4_BLOCK, axis=-1)
    # divide first, in float32. XLA rewrites `x / broadcast(g)` as `x * broadcast(1 / g)`, which is off by an
    # ulp; the optimization barrier keeps a true division (bit-identical to NumPy)
    divisor = jnp.broadcast_to(global_scale.astype(jnp.float32)[..., None], scale.shape)
    block_scale = scale.astype(jnp.float32) / lax.optimization_barrier(divisor)
    return values * jnp.repeat(block_scale, NVFP4_BLOCK, axis=-1)


# ----------------------------------------------------------------------------------------- containers


def _leading(shape) -> tuple[int, ...]:
    return tuple(shape[:-2])


@dataclasses.dataclass(frozen=True)
class Fp8BlockWeight:
    """FP8 block-quantized weight: e4m3 `weight` [.., out, in] and float32 `scale_inv` [.., ceil(out/128),
    ceil(in/128)]."""

    weight: jax.Array
    scale_inv: jax.Array
    format = "fp8_block"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def dequantize(self) -> jax.Array:
        return dequant_fp8_block(self.weight, self.scale_inv)

    def nbytes(self) -> int:
        return int(self.weight.size * 1 + self.scale_inv.size * 4)


@dataclasses.dataclass(frozen=True)
class Mxfp4Weight:
    """MXFP4 weight: uint8 `blocks` [.., out, in/32, 16] and uint8 E8M0 `scales` [.., out, in/32]."""

    blocks: jax.Array
    scales: jax.Array
    format = "mxfp4"

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, out_dim, groups, _ = self.blocks.shape
        return (*lead, out_dim, groups * MXFP4_BLOCK)

    def dequantize(self) -> jax.Array:
        return dequant_mxfp4(self.blocks, self.scales)

    def nbytes(self) -> int:
        return int(self.blocks.size + self.scales.size)


@dataclasses.dataclass(frozen=True)
class Nvfp4Weight:
    """NVFP4 weight: uint8 `packed` [.., out, in/2], e4m3 `scale` [.., out, in/16], float32 `global_scale`
    [1] or [.., 1]; it divides (compressed-tensors) or, with `global_multiplies`, multiplies (ModelOpt's
    `weight_scale_2`)."""

    packed: jax.Array
    scale: jax.Array
    global_scale: jax.Array
    global_multiplies: bool = False
    format = "nvfp4"

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, out_dim, half = self.packed.shape
        return (*lead, out_dim, 2 * half)

    def dequantize(self) -> jax.Array:
        return dequant_nvfp4(self.packed, self.scale, self.global_scale, self.global_multiplies)

    def nbytes(self) -> int:
        return int(self.packed.size + self.scale.size + self.global_scale.size * 4)


QuantizedWeight = Fp8BlockWeight | Mxfp4Weight | Nvfp4Weight

for _cls, _fields, _meta in ((Fp8BlockWeight, ["weight", "scale_inv"], []), (Mxfp4Weight, ["blocks", "scales"], []),
                             (Nvfp4Weight, ["packed", "scale", "global_scale"], ["global_multiplies"])):
    jax.tree_util.register_dataclass(_cls, data_fields=_fields, meta_fields=_meta)


# -------------------------------------------------------------------------- quantizers (for tests, benches)


def _to_e4m3(x: jax.Array) -> jax.Array:
    # astype(float8_e4m3fn) does not saturate (1000 -> NaN): clip first
    return jnp.clip(x, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)


def quantize_fp8_block(w: jax.Array) -> Fp8BlockWeight:
    """float [.., out, in] -> Fp8BlockWeight with the DeepSeek writer's rule scale_inv = amax(block) / 448."""
    w = w.astype(jnp.float32)
    *lead, out_dim, in_dim = w.shape
    bo, bi = -(-out_dim // FP8_BLOCK), -(-in_dim // FP8_BLOCK)
    padded = jnp.pad(w, [(0, 0)] * len(lead) + [(0, bo * FP8_BLOCK - out_dim), (0, bi * FP8_BLOCK - in_dim)])
    tiles = padded.reshape(*lead, bo, FP8_BLOCK, bi, FP8_BLOCK)
    amax = jnp.max(jnp.abs(tiles), axis=(-3, -1))
    scale_inv = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
    full = jnp.repeat(jnp.repeat(scale_inv, FP8_BLOCK, axis=-2), FP8_BLOCK, axis=-1)[..., :out_dim, :in_dim]
    return Fp8BlockWeight(_to_e4m3(w / full), scale_inv)


def _nearest_e2m1(x: jax.Array) -> jax.Array:
    """float32 -> E2M1 code of the nearest representable value (ties to the lower code)."""
    lut = jnp.asarray(E2M1_LUT[:8])
    code = jnp.argmin(jnp.abs(jnp.abs(x)[..., None] - lut), axis=-1).astype(jnp.int32)
    return jnp.where((x < 0) & (code > 0), code | 8, code)


def _pack(codes: jax.Array) -> jax.Array:
    """int codes [..., 2n] -> uint8 [..., n], the even element in the low nibble."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(jnp.uint8)


def quantize_mxfp4(w: jax.Array) -> Mxfp4Weight:
    """float [.., out, in] (in % 32 == 0) -> Mxfp4Weight; the shared exponent maps each block's amax to <= 6."""
    w = w.astype(jnp.float32)
    *lead, out_dim, in_dim = w.shape
    if in_dim % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs in % 32 == 0, got {in_dim}")
    groups = w.reshape(*lead, out_dim, in_dim // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = jnp.max(jnp.abs(groups), axis=-1)
    exp = jnp.where(amax > 0, jnp.ceil(jnp.log2(jnp.maximum(amax, 1e-30) / 6.0)), 0.0)
    s = jnp.clip(exp + 127, 1, 254).astype(jnp.int32)
    codes = _nearest_e2m1(groups / e8m0_to_f32(s)[..., None])
    return Mxfp4Weight(_pack(codes).reshape(*lead, out_dim, in_dim // MXFP4_BLOCK, 16), s.astype(jnp.uint8))


def quantize_nvfp4(w: jax.Array) -> Nvfp4Weight:
    """float [.., out, in] (in % 16 == 0) -> Nvfp4Weight with compressed-tensors' convention:
    global_scale = 448 * 6 / amax(w) (per leading index), block scale = e4m3(amax(block) / 6 * global_scale)."""
    w = w.astype(jnp.float32)
    *lead, out_dim, in_dim = w.shape
    if in_dim % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs in % 16 == 0, got {in_dim}")
    amax = jnp.max(jnp.abs(w), axis=(-2, -1), keepdims=True)
    global_scale = jnp.where(amax > 0, FP8_MAX * 6.0 / jnp.maximum(amax, 1e-30), 1.0).astype(jnp.float32)
    groups = w.reshape(*lead, out_dim, in_dim // NVFP4_BLOCK, NVFP4_BLOCK)
    block_amax = jnp.max(jnp.abs(groups), axis=-1)
    scale = _to_e4m3(block_amax / 6.0 * global_scale)  # global_scale is [.., 1, 1]
    block_scale = scale.astype(jnp.float32) / global_scale
    safe = jnp.where(block_scale > 0, block_scale, 1.0)
    codes = _nearest_e2m1(groups / safe[..., None])
    return Nvfp4Weight(_pack(codes.reshape(*lead, out_dim, in_dim)), scale, global_scale.reshape(*lead, 1))


def weight_bytes(w: Any) -> int:
    """Bytes a kernel must read for weight `w` (quantized container or array)."""
    if hasattr(w, "nbytes") and callable(w.nbytes):
        return w.nbytes()
    return int(w.size * jnp.dtype(w.dtype).itemsize)
