"""NVFP4 weights (compressed-tensors, ModelOpt): E2M1 values, two per byte, with one e4m3 scale per 16 values
and one float32 global scale per tensor.

  container   Nvfp4Weight: uint8 `packed` [.., out, in/2], e4m3 `scale` [.., out, in/16], float32 `global_scale`
              [1] or [.., 1]
  value       W[.., o, i] = LUT[code] * (float32(scale[.., o, i // 16]) / global_scale): compressed-tensors'
              global scale DIVIDES; ModelOpt's `weight_scale_2` multiplies (`global_multiplies`). The low nibble
              of a byte is the even element.
  HF          compressed-tensors ("nvfp4-pack-quantized"): every linear `X.weight` [out, in] not in `ignore` is
              stored as `X.weight_packed` U8 [out, in/2] + `X.weight_scale` F8_E4M3 [out, in/16] +
              `X.weight_global_scale` F32 [1]. ModelOpt (quant_algo NVFP4, read only): `X.weight` U8 [out, in/2]
              + `X.weight_scale` + `X.weight_scale_2` F32 [] (`X.input_scale` unused).
  native      format id 4 (5: a multiplying global scale): bytes, e4m3 scales, one global scale per expert
  Triton      nibbles times float32(e4m3 block scale) (exact in bf16: at most 6 significant bits); the global
              scale divides (or multiplies) the float32 accumulator once at the end
  TPU         as MXFP4 with e4m3 block scales; the global scale (SMEM) applies to the tile's accumulator
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plt

from ..._select import NotSupported
from ..._util import col, row
from ._bits import E2M1_LUT, FP8_MAX, lut, nearest_e2m1, nibbles_numpy, pack_fp4, to_e4m3, unpack_fp4
from ._compressed_tensors import METHOD as _CT, ignored
from ._record import DiskTensor, QuantFormat, TensorSite, TpuTiles, WeightParts, check
from ._tpu_tiles import fp4_accumulate, fp4_operands, fp4_vmem
from ._triton_tiles import e4m3_load, expand, fp4_tile, fp8_operand

__all__ = ["NVFP4_BLOCK", "Nvfp4Weight", "dequant_nvfp4", "dequant_nvfp4_numpy", "quantize_nvfp4", "FORMAT"]

NVFP4_BLOCK = 16
NATIVE_ID, NATIVE_ID_MULTIPLIES = 4, 5  # native/weights.h


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


jax.tree_util.register_dataclass(Nvfp4Weight, data_fields=["packed", "scale", "global_scale"],
                                 meta_fields=["global_multiplies"])


# ------------------------------------------------------------------------------------ values


def dequant_nvfp4(packed: jax.Array, scale: jax.Array, global_scale: jax.Array, global_multiplies: bool = False
                  ) -> jax.Array:
    """packed uint8 [.., out, in/2], scale e4m3 [.., out, in/16], global_scale float32 [1] (or [.., 1] per expert)
    -> float32 [.., out, in] = LUT[code] * (float32(scale) / global_scale) (`global_multiplies`: * global)."""
    values = lut(unpack_fp4(packed))  # [.., out, in]
    if global_multiplies:
        factor = jnp.broadcast_to(global_scale.astype(jnp.float32)[..., None], scale.shape)
        return values * jnp.repeat(scale.astype(jnp.float32) * factor, NVFP4_BLOCK, axis=-1)
    # divide first, in float32. XLA rewrites `x / broadcast(g)` as `x * broadcast(1 / g)`, which is off by an
    # ulp; the optimization barrier keeps a true division (bit-identical to NumPy)
    divisor = jnp.broadcast_to(global_scale.astype(jnp.float32)[..., None], scale.shape)
    block_scale = scale.astype(jnp.float32) / lax.optimization_barrier(divisor)
    return values * jnp.repeat(block_scale, NVFP4_BLOCK, axis=-1)


def dequant_nvfp4_numpy(packed: np.ndarray, scale: np.ndarray, global_scale: np.ndarray, group: int = NVFP4_BLOCK,
                        global_multiplies: bool = False) -> np.ndarray:
    """NumPy reference: packed u8 [out, in/2], scale e4m3 [out, in/group], global_scale f32 [1] -> float32
    [out, in]; the global scale divides (compressed-tensors) or multiplies (`global_multiplies`)."""
    vals = E2M1_LUT[nibbles_numpy(packed)]
    g = np.asarray(global_scale, np.float32).reshape(())
    s = scale.astype(np.float32) * g if global_multiplies else scale.astype(np.float32) / g
    return vals * np.repeat(s, group, axis=-1)[:, :vals.shape[-1]]


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
    scale = to_e4m3(block_amax / 6.0 * global_scale)  # global_scale is [.., 1, 1]
    block_scale = scale.astype(jnp.float32) / global_scale
    safe = jnp.where(block_scale > 0, block_scale, 1.0)
    codes = nearest_e2m1(groups / safe[..., None])
    return Nvfp4Weight(pack_fp4(codes.reshape(*lead, out_dim, in_dim)), scale, global_scale.reshape(*lead, 1))


# ------------------------------------------------------------------------------- HF checkpoint

_MODELOPT = "modelopt"
_CT_FORMATS = ("nvfp4-pack-quantized",)  # compressed-tensors `format` (absent: this one)


def _check_hf_config(q: Mapping[str, Any]) -> None:
    method, fmt = q.get("quant_method"), q.get("format")
    if method == _CT and fmt not in (None, *_CT_FORMATS):
        raise ValueError(f"unsupported compressed-tensors format {fmt!r} for NVFP4; supported: {_CT_FORMATS}")
    if method == _MODELOPT and str(q.get("quant_algo", "")).upper() != "NVFP4":
        raise ValueError(f"unsupported modelopt quant_algo {q.get('quant_algo')!r}; supported: 'NVFP4'")


def _disk_tensors(site: TensorSite, q: Mapping[str, Any]) -> list[DiskTensor] | None:
    if q.get("quant_method") == _MODELOPT:
        raise ValueError("checkpoint_layout: unsupported quant_method 'modelopt' (the layout is described for "
                         "compressed-tensors NVFP4)")
    base = site.name.removesuffix(".weight")
    if not site.linear or ignored(base, q):
        return None
    rows, width = site.shape
    if width % NVFP4_BLOCK:
        raise ValueError(f"tensor {site.name!r}: input width {width} is not a multiple of the NVFP4 block "
                         f"{NVFP4_BLOCK}")
    return [DiskTensor(base + ".weight_packed", "U8", (rows, width // 2), "fp4"),
            DiskTensor(base + ".weight_scale", "F8_E4M3", (rows, width // NVFP4_BLOCK), "e4m3_scale"),
            DiskTensor(base + ".weight_global_scale", "F32", (1,), "global_scale")]


def _find_parts(name: str, names: Collection[str]) -> WeightParts | None:
    if name.endswith(".weight_scale_2"):  # ModelOpt: X.weight u8, X.weight_scale, X.weight_scale_2
        base = name[: -len("_scale_2")]
        parts = (base, base + "_scale", name)
        variant, hidden = _MODELOPT, parts[1:] + (base[: -len("weight")] + "input_scale",)
    elif name.endswith(".weight_packed"):
        base = name[: -len("_packed")]
        parts = (name, base + "_scale", base + "_global_scale")
        variant, hidden = "", parts
    else:
        return None
    missing = [p for p in parts if p not in names]
    if missing:
        raise ValueError(f"NVFP4{' (ModelOpt)' if variant else ''} tensor {name!r} lacks {missing}")
    return WeightParts(base, parts, hidden, variant)


def _from_parts(parts: WeightParts, arrays: Sequence[Any], q: Mapping[str, Any]) -> Nvfp4Weight:
    packed, scale, gscale = arrays
    check(packed.dtype == np.uint8, f"NVFP4 packed weight must be uint8, got {packed.dtype}")
    check(tuple(scale.shape) == tuple(packed.shape[:-1]) + (packed.shape[-1] * 2 // NVFP4_BLOCK,),
          f"NVFP4 weight_scale shape {tuple(scale.shape)} does not fit weight_packed {tuple(packed.shape)} "
          "(one scale per 16 values)")
    check(int(np.prod(gscale.shape)) == 1,
          f"NVFP4 weight_global_scale must hold one value, got shape {tuple(gscale.shape)}")
    if isinstance(gscale, jax.ShapeDtypeStruct):
        gscale = jax.ShapeDtypeStruct((1,), np.float32)
    else:
        gscale = np.asarray(gscale).astype(np.float32).reshape(1)
    return Nvfp4Weight(packed, scale, gscale, parts.variant == _MODELOPT)


def _dequantize_numpy(parts: WeightParts, arrays: Sequence[np.ndarray], q: Mapping[str, Any]) -> np.ndarray:
    return dequant_nvfp4_numpy(*arrays, global_multiplies=parts.variant == _MODELOPT)


def _byte_nonfinite(name: str) -> tuple[str, int, str] | None:
    # e4m3 block scales stored as bytes
    return ("mask", 0x7F, "NVFP4 e4m3 scale NaN codes 0x7F/0xFF") if name.endswith(".weight_scale") else None


def _native_args(w: Nvfp4Weight) -> tuple[int, jax.Array, jax.Array, jax.Array]:
    glob = jnp.broadcast_to(w.global_scale.astype(jnp.float32).reshape(-1), (w.packed.shape[0],))
    return (NATIVE_ID_MULTIPLIES if w.global_multiplies else NATIVE_ID), w.packed, w.scale, glob


# ------------------------------------------------------------------------------- Pallas Triton


class _TritonTiles:
    """packed uint8 [G, N, K/2], scale e4m3 [G, N, K/16] (uint8 bit patterns when fp8_bits), global_scale
    float32 [G]."""

    num_refs = 3
    transposed = True

    def __init__(self, k_dim: int, global_multiplies: bool = False, fp8_bits: bool = False):
        self.k_dim = k_dim
        self.final_divides = not global_multiplies  # compressed-tensors divides, ModelOpt multiplies
        self.fp8_bits = fp8_bits

    def check_block_k(self, block_k: int) -> None:
        if block_k % NVFP4_BLOCK:
            raise NotSupported(f"NVFP4 kernel needs block_k a multiple of 16, got {block_k}")

    def tile(self, refs, g, k0, ks, ns, kmask, nmask, compute_dtype):
        p_ref, s_ref, _ = refs
        bn, bk = ns.shape[0], ks.shape[0]
        kb = k0 // 2 + jnp.arange(bk // 2, dtype=jnp.int32)
        packed = plt.load(p_ref.at[g, row(ns), col(kb)], mask=row(nmask) & col(kb < self.k_dim // 2), other=0)
        sg = k0 // NVFP4_BLOCK + jnp.arange(bk // NVFP4_BLOCK, dtype=jnp.int32)
        s = e4m3_load(s_ref, (g, row(ns), col(sg)), row(nmask) & col(sg < self.k_dim // NVFP4_BLOCK),
                      self.fp8_bits)
        scale = expand(s, bn, bk // NVFP4_BLOCK, NVFP4_BLOCK // 2)
        # nibble x e4m3 has at most 6 significant bits: exact in bf16; the global scale applies at the end
        return fp4_tile(packed, scale).astype(compute_dtype)

    def step_scale(self, refs, g, k0, ns, nmask):
        return None

    def final_scale(self, refs, g):
        _, _, gs_ref = refs
        return gs_ref[g]


def _triton(w: Nvfp4Weight, num_groups: int, fp8_bits: bool):
    _, n_dim, half = w.packed.shape
    global_scale = jnp.broadcast_to(w.global_scale.astype(jnp.float32).reshape(-1), (num_groups,))
    return (_TritonTiles(2 * half, w.global_multiplies, fp8_bits),
            (w.packed, fp8_operand(w.scale, fp8_bits), global_scale), n_dim, 2 * half)


# ------------------------------------------------------------------------------- Mosaic TPU


def _tpu_operands(x, w, num_groups, n_dim, k_dim, tm, tn):
    acts, weights, specs = fp4_operands(x, w.packed, w.scale, tm, tn, k_dim)
    gs = jnp.broadcast_to(w.global_scale.astype(jnp.float32).reshape(-1), (num_groups,))
    return acts, weights + (gs,), specs + [pl.BlockSpec(memory_space=pltpu.SMEM)]


def _tpu_accumulator(w: Nvfp4Weight):
    divides = not w.global_multiplies  # static: the container's meta field

    def accumulate(refs, expert, **kw):
        acc = fp4_accumulate(refs, per_scale=NVFP4_BLOCK, scale_values=lambda s_ref: s_ref[...].astype(jnp.float32),
                             **kw)
        gs = refs[4][expert]  # the expert's global scale (SMEM)
        return acc / gs if divides else acc * gs
    return accumulate


def _tpu_vmem(tm: int, tn: int, k_dim: int) -> tuple[int, int, int]:
    return fp4_vmem(NVFP4_BLOCK, tn, k_dim)


def _tpu_check(w: Nvfp4Weight) -> None:
    if jnp.dtype(w.scale.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise NotSupported(f"NVFP4 block scales must be float8_e4m3fn, got {w.scale.dtype}")


FORMAT = QuantFormat(
    name="nvfp4", container=Nvfp4Weight, hf_methods=(_CT, _MODELOPT), hf_formats=_CT_FORMATS,
    check_hf_config=_check_hf_config, roles={"fp4": ("U8",), "e4m3_scale": ("F8_E4M3", "U8"),
                                             "global_scale": ("F32",)},
    disk_tensors=_disk_tensors, find_parts=_find_parts, from_parts=_from_parts, dequantize_numpy=_dequantize_numpy,
    byte_nonfinite=_byte_nonfinite, quantize=quantize_nvfp4, native_args=_native_args, native_int8=True,
    triton=_triton,
    tpu=TpuTiles(operands=_tpu_operands, accumulator=_tpu_accumulator, vmem=_tpu_vmem, check=_tpu_check))
