"""FP8 block-quantized weights (DeepSeek-V3 / Kimi-K2 / GLM): e4m3 values with one float32 scale per 128 x 128
block.

  container   Fp8BlockWeight: e4m3 `weight` [.., out, in], float32 `scale_inv` [.., ceil(out/128), ceil(in/128)]
  value       W[.., o, i] = float32(weight[.., o, i]) * scale_inv[.., o // 128, i // 128] (edge blocks partial)
  HF          quant_method "fp8": every linear `X.weight` [out, in] is stored as F8_E4M3 [out, in] plus
              `X.weight_scale_inv` F32 (or BF16) [ceil(out/b0), ceil(in/b1)], b = weight_block_size
  native      format id 2: the e4m3 bytes and the float32 scales
  Triton      the e4m3 tile -> compute dtype (exact in bf16); the block scale is constant over a K step (block_k
              divides 128), so it multiplies the step's float32 partial product per output column (no
              per-element multiply, no rounding of w * scale to bf16). Without e4m3 hardware (A100) the bytes
              travel as uint8 and integer operations decode them.
  TPU         per 128-column block of K: x . e4m3(w).T in the compute dtype, times the block's scale row.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import triton as plt

from ..._select import NotSupported
from ..._util import cdiv, col, row
from ._bits import FP8_MAX, to_e4m3
from ._record import DiskTensor, QuantFormat, TensorSite, TpuTiles, WeightParts, absent, check
from ._tpu_tiles import dot_nt, round_up, rows_spec, weight_spec
from ._triton_tiles import e4m3_load, fp8_operand

__all__ = ["FP8_BLOCK", "Fp8BlockWeight", "dequant_fp8_block", "dequant_fp8_block_numpy", "quantize_fp8_block",
           "FORMAT"]

FP8_BLOCK = 128
NATIVE_ID = 2  # native/weights.h
_SCALE = ".weight_scale_inv"


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


jax.tree_util.register_dataclass(Fp8BlockWeight, data_fields=["weight", "scale_inv"], meta_fields=[])


# ------------------------------------------------------------------------------------ values


def dequant_fp8_block(weight: jax.Array, scale_inv: jax.Array, block_size: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)
                      ) -> jax.Array:
    """float32(weight[.., o, i]) * scale_inv[.., o // b0, i // b1]: float32 [.., out, in]."""
    out_dim, in_dim = weight.shape[-2:]
    bo, bi = block_size
    scale = jnp.repeat(jnp.repeat(scale_inv.astype(jnp.float32), bo, axis=-2), bi, axis=-1)
    return weight.astype(jnp.float32) * scale[..., :out_dim, :in_dim]


def dequant_fp8_block_numpy(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)
                            ) -> np.ndarray:
    """NumPy reference: w [out, in] (float8) * scale_inv [ceil(out/b0), ceil(in/b1)] per block -> float32."""
    out, inp = w.shape
    if scale_inv.shape != (-(-out // block[0]), -(-inp // block[1])):
        raise ValueError(f"weight_scale_inv shape {scale_inv.shape} does not fit weight {w.shape} in "
                         f"{block[0]}x{block[1]} blocks")
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), block[0], 0), block[1], 1)[:out, :inp]
    return w.astype(np.float32) * s


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
    return Fp8BlockWeight(to_e4m3(w / full), scale_inv)


# ------------------------------------------------------------------------------- HF checkpoint


def _block(q: Mapping[str, Any]) -> tuple[int, int]:
    return tuple(q.get("weight_block_size") or (FP8_BLOCK, FP8_BLOCK))


def _check_hf_config(q: Mapping[str, Any]) -> None:
    return None


def _disk_tensors(site: TensorSite, q: Mapping[str, Any]) -> list[DiskTensor] | None:
    if not site.linear:
        return None
    block = _block(q)
    grid = (math.ceil(site.shape[0] / block[0]), math.ceil(site.shape[1] / block[1]))
    return [DiskTensor(site.name, "F8_E4M3", site.shape, "fp8"),
            DiskTensor(site.name.removesuffix(".weight") + _SCALE, "F32", grid, "scale_inv")]


def _find_parts(name: str, names: Collection[str]) -> WeightParts | None:
    if not name.endswith(_SCALE):
        return None
    base = name[: -len("_scale_inv")]
    return WeightParts(base, (base, name), (name,))


def _float32(a: Any) -> Any:
    if isinstance(a, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(a.shape, np.float32)
    return np.asarray(a).astype(np.float32)


def _from_parts(parts: WeightParts, arrays: Sequence[Any], q: Mapping[str, Any]) -> Fp8BlockWeight:
    w, s = arrays
    check(w.dtype.name == "float8_e4m3fn", f"FP8 weight must be float8_e4m3fn, got {w.dtype}")
    want = tuple(w.shape[:-2]) + tuple(-(-d // FP8_BLOCK) for d in w.shape[-2:])
    check(tuple(s.shape) == want, f"weight_scale_inv shape {tuple(s.shape)} does not fit weight {tuple(w.shape)} "
                                  "in 128x128 blocks")
    return Fp8BlockWeight(w, _float32(s))


def _dequantize_numpy(parts: WeightParts, arrays: Sequence[np.ndarray], q: Mapping[str, Any]) -> np.ndarray:
    return dequant_fp8_block_numpy(arrays[0], arrays[1], _block(q))


def _native_args(w: Fp8BlockWeight) -> tuple[int, jax.Array, jax.Array, jax.Array]:
    return NATIVE_ID, w.weight, w.scale_inv.astype(jnp.float32), absent()


# ------------------------------------------------------------------------------- Pallas Triton


class _TritonTiles:
    """weight e4m3 [G, N, K] (uint8 bit patterns when fp8_bits), scale_inv float32 [G, ceil(N/128), ceil(K/128)]."""

    num_refs = 2
    transposed = True

    def __init__(self, fp8_bits: bool = False):
        self.fp8_bits = fp8_bits

    def check_block_k(self, block_k: int) -> None:
        if FP8_BLOCK % block_k:
            raise NotSupported(f"FP8 block kernel needs block_k dividing 128, got {block_k}")

    def tile(self, refs, g, k0, ks, ns, kmask, nmask, compute_dtype):
        w_ref, _ = refs
        w = e4m3_load(w_ref, (g, row(ns), col(ks)), row(nmask) & col(kmask), self.fp8_bits)
        return w.astype(compute_dtype)  # e4m3 -> bf16 is exact

    def step_scale(self, refs, g, k0, ns, nmask):
        _, s_ref = refs
        return plt.load(s_ref.at[g, ns // FP8_BLOCK, k0 // FP8_BLOCK], mask=nmask, other=0)

    def final_scale(self, refs, g):
        return None


def _triton(w: Fp8BlockWeight, num_groups: int, fp8_bits: bool):
    _, n_dim, k_dim = w.weight.shape
    if w.weight.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"FP8 block weight must be float8_e4m3fn, got {w.weight.dtype}")
    return (_TritonTiles(fp8_bits), (fp8_operand(w.weight, fp8_bits), w.scale_inv.astype(jnp.float32)),
            n_dim, k_dim)


# ------------------------------------------------------------------------------- Mosaic TPU


def _tpu_operands(x, w, num_groups, n_dim, k_dim, tm, tn):
    kb = cdiv(k_dim, FP8_BLOCK)
    # [G, ceil(N/128), kb] -> [G, kb, N]: one float32 row of per-column scales per 128-column block of K
    scale = jnp.repeat(jnp.swapaxes(w.scale_inv.astype(jnp.float32), 1, 2), FP8_BLOCK, axis=2)[:, :, :n_dim]
    specs = [rows_spec(tm, k_dim), weight_spec((tn, k_dim), 1), weight_spec((kb, tn), 2)]
    return (x,), (w.weight, scale), specs


def _tpu_accumulate(refs, expert, *, tm, tn, k_dim, compute_dtype, precision):
    """sum over 128-column blocks b of (x[:, b] . e4m3(w)[:, b].T) * scale[b, n]: [tm, tn] float32."""
    x_ref, w_ref, s_ref = refs
    acc = jnp.zeros((tm, tn), jnp.float32)
    for block, c0 in enumerate(range(0, k_dim, FP8_BLOCK)):
        c1 = min(c0 + FP8_BLOCK, k_dim)
        wc = w_ref[:, c0:c1].astype(compute_dtype)  # e4m3 -> bf16 / f32: exact
        part = dot_nt(x_ref[:, c0:c1].astype(compute_dtype), wc, precision)
        acc = acc + part * s_ref[block:block + 1, :]
    return acc


def _tpu_accumulator(w: Fp8BlockWeight):
    return _tpu_accumulate


def _tpu_vmem(tm: int, tn: int, k_dim: int) -> tuple[int, int, int]:
    weight = round_up(tn, 32) * round_up(k_dim, 128)
    scale = round_up(cdiv(k_dim, FP8_BLOCK), 8) * round_up(tn, 128) * 4
    return weight, scale, 4 * tn * FP8_BLOCK * 4


def _tpu_check(w: Fp8BlockWeight) -> None:
    if jnp.dtype(w.weight.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise NotSupported(f"FP8 block weights must be float8_e4m3fn, got {w.weight.dtype}")


FORMAT = QuantFormat(
    name="fp8_block", container=Fp8BlockWeight, hf_methods=("fp8",), hf_formats=(),
    check_hf_config=_check_hf_config,
    roles={"fp8": ("F8_E4M3",), "scale_inv": ("F32", "BF16")}, disk_tensors=_disk_tensors,
    find_parts=_find_parts, from_parts=_from_parts, dequantize_numpy=_dequantize_numpy,
    byte_nonfinite=lambda name: None, quantize=quantize_fp8_block,
    native_args=_native_args, native_int8=False, triton=_triton,
    tpu=TpuTiles(operands=_tpu_operands, accumulator=_tpu_accumulator, vmem=_tpu_vmem, check=_tpu_check))
