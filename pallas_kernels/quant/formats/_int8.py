"""Int8 weights with one float scale per output channel (compressed-tensors `int-quantized`, the W8A8 / W8A16
checkpoints of vLLM's llm-compressor; symmetric: no zero point).

  container   Int8Weight: int8 `weight` [.., out, in], float32 `scale` [.., out, 1]
  value       W[.., o, i] = float32(weight[.., o, i]) * scale[.., o, 0]
  HF          quant_method "compressed-tensors", format "int-quantized", weights {num_bits: 8, type: int,
              symmetric: true, strategy: channel}: every linear `X.weight` [out, in] not in `ignore` is stored as
              I8 [out, in] plus `X.weight_scale` (F32 / BF16 / F16) [out, 1]. Activations stay float here: a
              W8A8 checkpoint's dynamic per-token activation quantization is not applied (its weights are the
              same), static activation scales are refused.
  native      format id 7: the int8 codes and the float32 scales [.., out]
  Triton      the int8 tile -> compute dtype (exact in bf16: |v| <= 128), the channel scale multiplies each K
              step's float32 partial product per output column (no rounding of w * scale to bf16)
  TPU         per 512-column chunk of K: x . int8(w).T in the compute dtype, the float32 tile times the
              channel scales once at the end
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
from ._compressed_tensors import METHOD as _CT, ignored
from ._record import DiskTensor, QuantFormat, TensorSite, TpuTiles, WeightParts, absent, check
from ._tpu_tiles import CHUNK_K, dot_nt, round_up, rows_spec, weight_spec

__all__ = ["INT8_MAX", "Int8Weight", "dequant_int8", "dequant_int8_numpy", "quantize_int8", "FORMAT"]

INT8_MAX = 127  # the quantizer's symmetric range [-127, 127] (a checkpoint's -128 reads as well)
NATIVE_ID = 7  # native/weights.h
_SCALE = ".weight_scale"
_CT_FORMATS = ("int-quantized",)  # compressed-tensors `format`
#: compressed-tensors' per-group `weights` settings this format reads (key -> the one accepted value)
_WEIGHT_ARGS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}


@dataclasses.dataclass(frozen=True)
class Int8Weight:
    """Int8 weight: int8 `weight` [.., out, in] and float32 `scale` [.., out, 1] (one per output channel)."""

    weight: jax.Array
    scale: jax.Array
    format = "int8"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def dequantize(self) -> jax.Array:
        return dequant_int8(self.weight, self.scale)

    def nbytes(self) -> int:
        return int(self.weight.size * 1 + self.scale.size * 4)


jax.tree_util.register_dataclass(Int8Weight, data_fields=["weight", "scale"], meta_fields=[])


# ------------------------------------------------------------------------------------ values


def dequant_int8(weight: jax.Array, scale: jax.Array) -> jax.Array:
    """float32(weight[.., o, i]) * scale[.., o, 0]: float32 [.., out, in]."""
    return weight.astype(jnp.float32) * scale.astype(jnp.float32)


def dequant_int8_numpy(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """NumPy reference: weight int8 [.., out, in] * scale [.., out, 1] -> float32."""
    if tuple(scale.shape) != tuple(weight.shape[:-1]) + (1,):
        raise ValueError(f"weight_scale shape {tuple(scale.shape)} does not fit weight {tuple(weight.shape)} "
                         "(one scale per output channel: [out, 1])")
    return weight.astype(np.float32) * scale.astype(np.float32)


def quantize_int8(w: jax.Array) -> Int8Weight:
    """float [.., out, in] -> Int8Weight: scale = amax(row) / 127, codes round(w / scale) (to nearest even)."""
    w = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0).astype(jnp.float32)
    codes = jnp.clip(jnp.round(w / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return Int8Weight(codes, scale)


# ------------------------------------------------------------------------------- HF checkpoint


def _check_hf_config(q: Mapping[str, Any]) -> None:
    """ValueError naming the key unless every config group quantizes weights as this format reads them."""
    if q.get("format") not in _CT_FORMATS:
        raise ValueError(f"quantization_config.format: expected one of {_CT_FORMATS}, got {q.get('format')!r}")
    groups = q.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError("quantization_config.config_groups: expected an object of one or more groups")
    for name, group in groups.items():
        where = f"quantization_config.config_groups.{name}"
        weights = group.get("weights") if isinstance(group, Mapping) else None
        if not isinstance(weights, Mapping):
            raise ValueError(f"{where}.weights: expected an object")
        for key, want in _WEIGHT_ARGS.items():
            if weights.get(key) != want:
                raise ValueError(f"{where}.weights.{key}: expected {want!r}, got {weights.get(key)!r}")
        if weights.get("dynamic"):
            raise ValueError(f"{where}.weights.dynamic: expected false (weights quantized on disk)")
        acts = group.get("input_activations")
        if acts is not None and not (isinstance(acts, Mapping) and acts.get("dynamic") is True):
            raise ValueError(f"{where}.input_activations: expected null or dynamic quantization (static "
                             "activation scales are not supported)")


def _disk_tensors(site: TensorSite, q: Mapping[str, Any]) -> list[DiskTensor] | None:
    base = site.name.removesuffix(".weight")
    if not site.linear or ignored(base, q):
        return None
    return [DiskTensor(site.name, "I8", site.shape, "int8"),
            DiskTensor(base + _SCALE, "F32", (site.shape[0], 1), "channel_scale")]


def _find_parts(name: str, names: Collection[str]) -> WeightParts | None:
    if not name.endswith(_SCALE):
        return None
    base = name[: -len("_scale")]
    if base + "_packed" in names or base + "_scale_2" in names:  # NVFP4's parts (compressed-tensors, ModelOpt)
        return None
    if base not in names:  # not a weight's scale (another convention's tensor): left to the loaders
        return None
    zero = base + "_zero_point"
    parts = (base, name, zero) if zero in names else (base, name)
    return WeightParts(base, parts, parts[1:])


def _float32(a: Any) -> Any:
    if isinstance(a, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(a.shape, np.float32)
    return np.asarray(a).astype(np.float32)


def _from_parts(parts: WeightParts, arrays: Sequence[Any], q: Mapping[str, Any]) -> Int8Weight:
    w, s = arrays[:2]
    check(len(arrays) == 2, "int8 weight_zero_point: asymmetric int8 weights are not supported (expected "
                            "symmetric weights without a zero point)")
    check(w.dtype == np.int8, f"int8 weight must be int8, got {w.dtype}")
    check(tuple(s.shape) == tuple(w.shape[:-1]) + (1,),
          f"weight_scale shape {tuple(s.shape)} does not fit weight {tuple(w.shape)} (one scale per output "
          "channel: [out, 1])")
    return Int8Weight(w, _float32(s))


def _dequantize_numpy(parts: WeightParts, arrays: Sequence[np.ndarray], q: Mapping[str, Any]) -> np.ndarray:
    return dequant_int8_numpy(arrays[0], arrays[1])


def _native_args(w: Int8Weight) -> tuple[int, jax.Array, jax.Array, jax.Array]:
    return NATIVE_ID, w.weight, w.scale.astype(jnp.float32).reshape(w.scale.shape[:-1]), absent()


# ------------------------------------------------------------------------------- Pallas Triton


class _TritonTiles:
    """weight int8 [G, N, K], scale float32 [G, N]."""

    num_refs = 2
    transposed = True

    def check_block_k(self, block_k: int) -> None:
        return None

    def tile(self, refs, g, k0, ks, ns, kmask, nmask, compute_dtype):
        w_ref, _ = refs
        w = plt.load(w_ref.at[g, row(ns), col(ks)], mask=row(nmask) & col(kmask), other=0)
        return w.astype(compute_dtype)  # int8 -> bf16 is exact

    def step_scale(self, refs, g, k0, ns, nmask):
        _, s_ref = refs
        return plt.load(s_ref.at[g, ns], mask=nmask, other=0)

    def final_scale(self, refs, g):
        return None


def _triton(w: Int8Weight, num_groups: int, fp8_bits: bool):
    _, n_dim, k_dim = w.weight.shape
    if w.weight.dtype != jnp.int8:
        raise ValueError(f"int8 weight must be int8, got {w.weight.dtype}")
    return _TritonTiles(), (w.weight, w.scale.astype(jnp.float32).reshape(-1, n_dim)), n_dim, k_dim


# ------------------------------------------------------------------------------- Mosaic TPU


def _tpu_operands(x, w, num_groups, n_dim, k_dim, tm, tn):
    scale = jnp.swapaxes(w.scale.astype(jnp.float32), 1, 2)  # [G, 1, N]: the tile's scales along lanes
    specs = [rows_spec(tm, k_dim), weight_spec((tn, k_dim), 1), weight_spec((1, tn), 2)]
    return (x,), (w.weight, scale), specs


def _tpu_accumulate(refs, expert, *, tm, tn, k_dim, compute_dtype, precision):
    """(sum over 512-column chunks c of x[:, c] . int8(w)[:, c].T) * scale[n]: [tm, tn] float32."""
    x_ref, w_ref, s_ref = refs
    acc = jnp.zeros((tm, tn), jnp.float32)
    for c0 in range(0, k_dim, CHUNK_K):
        c1 = min(c0 + CHUNK_K, k_dim)
        # int8 -> int32 -> float: the widening Mosaic lowers on every TPU generation; exact in bf16
        wc = w_ref[:, c0:c1].astype(jnp.int32).astype(jnp.float32).astype(compute_dtype)
        acc = acc + dot_nt(x_ref[:, c0:c1].astype(compute_dtype), wc, precision)
    return acc * s_ref[...]


def _tpu_accumulator(w: Int8Weight):
    return _tpu_accumulate


def _tpu_vmem(tm: int, tn: int, k_dim: int) -> tuple[int, int, int]:
    weight = round_up(tn, 32) * round_up(k_dim, 128)
    scale = 8 * round_up(tn, 128) * 4
    return weight, scale, 3 * tn * CHUNK_K * 4  # one chunk as int32, float32 and the compute dtype


def _tpu_check(w: Int8Weight) -> None:
    if jnp.dtype(w.weight.dtype) != jnp.dtype(jnp.int8):
        raise NotSupported(f"int8 weights must be int8, got {w.weight.dtype}")


FORMAT = QuantFormat(
    name="int8", container=Int8Weight, hf_methods=(_CT,), hf_formats=_CT_FORMATS,
    check_hf_config=_check_hf_config,
    roles={"int8": ("I8",), "channel_scale": ("F32", "BF16", "F16")}, disk_tensors=_disk_tensors,
    find_parts=_find_parts, from_parts=_from_parts, dequantize_numpy=_dequantize_numpy,
    byte_nonfinite=lambda name: None, quantize=quantize_int8,
    native_args=_native_args, native_int8=False, triton=_triton,
    tpu=TpuTiles(operands=_tpu_operands, accumulator=_tpu_accumulator, vmem=_tpu_vmem, check=_tpu_check))
