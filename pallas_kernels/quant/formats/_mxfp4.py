"""MXFP4 weights (GPT-OSS): E2M1 values, two per byte, with one E8M0 power-of-two scale per 32 values.

  container   Mxfp4Weight: uint8 `blocks` [.., out, in/32, 16] and uint8 E8M0 `scales` [.., out, in/32]
  value       W[.., o, 32g + 2j] = LUT[b & 15] * 2**(s - 127), W[.., o, 32g + 2j + 1] = LUT[b >> 4] * 2**(s - 127)
              (b = blocks[.., o, g, j], s = scales[.., o, g], UNSIGNED exponent)
  HF          quant_method "mxfp4": the fused expert weights [E, in, out] (the family's `fused_experts`, not their
              biases) are stored as `<w>_blocks` U8 [E, out, in/32, 16] + `<w>_scales` U8 [E, out, in/32]; the
              rest stays float (modules_to_not_convert)
  native      format id 3: the bytes viewed as [.., out, in/2] and the exponents
  Triton      bytes -> two E2M1 nibbles by integer ops times 2**(s - 127) built from the exponent bits (exact in
              bf16), the two halves interleaved in registers
  TPU         x's even and odd columns against the low and high nibbles, per 512-column chunk of K
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import triton as plt

from ..._select import NotSupported
from ..._util import col, row
from ._bits import E2M1_LUT, e8m0_to_f32, lut, nearest_e2m1, nibbles_numpy, pack_fp4, unpack_fp4
from ._record import DiskTensor, QuantFormat, TensorSite, TpuTiles, WeightParts, absent, check
from ._tpu_tiles import fp4_accumulate, fp4_operands, fp4_vmem
from ._triton_tiles import expand, fp4_tile

__all__ = ["MXFP4_BLOCK", "Mxfp4Weight", "dequant_mxfp4", "dequant_mxfp4_numpy", "quantize_mxfp4", "FORMAT"]

MXFP4_BLOCK = 32
NATIVE_ID = 3  # native/weights.h


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


jax.tree_util.register_dataclass(Mxfp4Weight, data_fields=["blocks", "scales"], meta_fields=[])


# ------------------------------------------------------------------------------------ values


def dequant_mxfp4(blocks: jax.Array, scales: jax.Array) -> jax.Array:
    """blocks uint8 [.., out, in/32, 16], scales uint8 [.., out, in/32] -> float32 [.., out, in]."""
    values = lut(unpack_fp4(blocks))  # [.., out, in/32, 32]
    values = values * e8m0_to_f32(scales)[..., None]
    return values.reshape(*values.shape[:-2], values.shape[-2] * values.shape[-1])


def dequant_mxfp4_numpy(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """NumPy reference: blocks u8 [..., G, 16], scales u8 [..., G] (E8M0, unsigned) -> float32 [..., 32 G]."""
    vals = E2M1_LUT[nibbles_numpy(blocks)]  # [..., G, 32]
    vals = np.ldexp(vals, scales.astype(np.int32)[..., None] - 127).astype(np.float32)
    return vals.reshape(vals.shape[:-2] + (-1,))


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
    codes = nearest_e2m1(groups / e8m0_to_f32(s)[..., None])
    return Mxfp4Weight(pack_fp4(codes).reshape(*lead, out_dim, in_dim // MXFP4_BLOCK, 16), s.astype(jnp.uint8))


# ------------------------------------------------------------------------------- HF checkpoint


def _check_hf_config(q: Mapping[str, Any]) -> None:
    return None


def _disk_tensors(site: TensorSite, q: Mapping[str, Any]) -> list[DiskTensor] | None:
    if not site.fused_expert or site.name.endswith("_bias"):
        return None
    experts, width, outputs = site.shape  # float layout [E, in, out]
    if width % MXFP4_BLOCK:
        raise ValueError(f"tensor {site.name!r}: input width {width} is not a multiple of the MXFP4 block "
                         f"{MXFP4_BLOCK}")
    groups = width // MXFP4_BLOCK
    return [DiskTensor(site.name + "_blocks", "U8", (experts, outputs, groups, 16), "fp4"),
            DiskTensor(site.name + "_scales", "U8", (experts, outputs, groups), "e8m0")]


def _find_parts(name: str, names: Collection[str]) -> WeightParts | None:
    if not name.endswith("_blocks") or name[: -len("_blocks")] + "_scales" not in names:
        return None
    base = name[: -len("_blocks")]
    both = (name, base + "_scales")
    return WeightParts(base, both, both)


def _from_parts(parts: WeightParts, arrays: Sequence[Any], q: Mapping[str, Any]) -> Mxfp4Weight:
    blocks, scales = arrays
    check(blocks.dtype == np.uint8 and scales.dtype == np.uint8, "MXFP4 blocks/scales must be uint8")
    check(len(blocks.shape) >= 3 and blocks.shape[-1] == 16 and tuple(scales.shape) == tuple(blocks.shape[:-1]),
          f"MXFP4 blocks {tuple(blocks.shape)} must be [..., G, 16] with scales [..., G], got scales "
          f"{tuple(scales.shape)}")
    return Mxfp4Weight(blocks, scales)


def _dequantize_numpy(parts: WeightParts, arrays: Sequence[np.ndarray], q: Mapping[str, Any]) -> np.ndarray:
    # the checkpoint's float layout of a fused expert weight is [E, in, out]
    return np.swapaxes(dequant_mxfp4_numpy(arrays[0], arrays[1]), -1, -2).copy()


def _byte_nonfinite(name: str) -> tuple[str, int, str] | None:
    return ("equal", 0xFF, "MXFP4 E8M0 scale code 0xFF = NaN") if name.endswith("_scales") else None


def _native_args(w: Mxfp4Weight) -> tuple[int, jax.Array, jax.Array, jax.Array]:
    blocks = w.blocks
    return NATIVE_ID, blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1]), w.scales, absent()


# ------------------------------------------------------------------------------- Pallas Triton


class _TritonTiles:
    """blocks viewed as uint8 [G, N, K/2], scales uint8 [G, N, K/32]."""

    num_refs = 2
    transposed = True

    def __init__(self, k_dim: int):
        self.k_dim = k_dim

    def check_block_k(self, block_k: int) -> None:
        if block_k % MXFP4_BLOCK:
            raise NotSupported(f"MXFP4 kernel needs block_k a multiple of 32, got {block_k}")

    def tile(self, refs, g, k0, ks, ns, kmask, nmask, compute_dtype):
        b_ref, s_ref = refs
        bn, bk = ns.shape[0], ks.shape[0]
        kb = k0 // 2 + jnp.arange(bk // 2, dtype=jnp.int32)
        packed = plt.load(b_ref.at[g, row(ns), col(kb)], mask=row(nmask) & col(kb < self.k_dim // 2), other=0)
        sg = k0 // MXFP4_BLOCK + jnp.arange(bk // MXFP4_BLOCK, dtype=jnp.int32)
        s = plt.load(s_ref.at[g, row(ns), col(sg)], mask=row(nmask) & col(sg < self.k_dim // MXFP4_BLOCK),
                     other=127)
        scale = expand(e8m0_to_f32(s), bn, bk // MXFP4_BLOCK, MXFP4_BLOCK // 2)
        return fp4_tile(packed, scale).astype(compute_dtype)  # exact in bf16

    def step_scale(self, refs, g, k0, ns, nmask):
        return None

    def final_scale(self, refs, g):
        return None


def _triton(w: Mxfp4Weight, num_groups: int, fp8_bits: bool):
    g, n_dim, groups, _ = w.blocks.shape
    k_dim = groups * MXFP4_BLOCK
    return _TritonTiles(k_dim), (w.blocks.reshape(g, n_dim, k_dim // 2), w.scales), n_dim, k_dim


# ------------------------------------------------------------------------------- Mosaic TPU


def _tpu_operands(x, w, num_groups, n_dim, k_dim, tm, tn):
    return fp4_operands(x, w.blocks.reshape(num_groups, n_dim, k_dim // 2), w.scales, tm, tn, k_dim)


def _tpu_accumulate(refs, expert, **kw):
    return fp4_accumulate(refs, per_scale=MXFP4_BLOCK, scale_values=lambda s_ref: e8m0_to_f32(s_ref[...]), **kw)


def _tpu_accumulator(w: Mxfp4Weight):
    return _tpu_accumulate


def _tpu_vmem(tm: int, tn: int, k_dim: int) -> tuple[int, int, int]:
    return fp4_vmem(MXFP4_BLOCK, tn, k_dim)


def _tpu_check(w: Mxfp4Weight) -> None:
    return None


FORMAT = QuantFormat(
    name="mxfp4", container=Mxfp4Weight, hf_methods=("mxfp4",), hf_formats=(),
    check_hf_config=_check_hf_config,
    roles={"fp4": ("U8",), "e8m0": ("U8",)}, disk_tensors=_disk_tensors, find_parts=_find_parts,
    from_parts=_from_parts, dequantize_numpy=_dequantize_numpy, byte_nonfinite=_byte_nonfinite,
    quantize=quantize_mxfp4,
    native_args=_native_args, native_int8=True, triton=_triton,
    tpu=TpuTiles(operands=_tpu_operands, accumulator=_tpu_accumulator, vmem=_tpu_vmem, check=_tpu_check))
