"""Weights with one float scale per output channel (compressed-tensors, the W8A8 / W8A16 checkpoints of vLLM's
llm-compressor; symmetric: no zero point), in two element types, one format each:

  format        container          codes                          compressed-tensors
  int8          Int8Weight         int8 [.., out, in]             format "int-quantized", weights type "int"
  fp8_channel   Fp8ChannelWeight   float8_e4m3fn [.., out, in]    format "float-quantized", weights type "float"

  value       W[.., o, i] = float32(codes[.., o, i]) * scale[.., o, 0], scale float32 [.., out, 1]
  HF          quant_method "compressed-tensors", weights {num_bits: 8, symmetric: true, strategy: channel (or
              tensor: one scale, read as the same scale for every channel)}: every linear `X.weight` [out, in]
              not in `ignore` is stored as I8 / F8_E4M3 [out, in] plus `X.weight_scale` (F32 / BF16 / F16)
              [out, 1] ([1] per tensor). Activations stay float here: a W8A8 checkpoint's dynamic per-token
              activation quantization is not applied (its weights are the same), static activation scales are
              refused.
  native      format ids 7 (int8) and 8 (e4m3): the codes and the float32 scales [.., out]
  Triton      the code tile -> compute dtype (exact in bf16: int8 |v| <= 128, e4m3 3 mantissa bits; e4m3 as uint8
              bit patterns and integer decoding on targets without e4m3 conversion), the channel scale
              multiplies each K step's float32 partial product per output column
  TPU         per 512-column chunk of K: x . codes.T in the compute dtype, the float32 tile times the channel
              scales once at the end
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
from ._bits import FP8_MAX, to_e4m3
from ._compressed_tensors import METHOD as _CT, ignored
from ._record import DiskTensor, QuantFormat, TensorSite, TpuTiles, WeightParts, absent, check
from ._tpu_tiles import CHUNK_K, dot_nt, round_up, rows_spec, weight_spec
from ._triton_tiles import e4m3_load, fp8_operand

__all__ = ["INT8_MAX", "Int8Weight", "Fp8ChannelWeight", "dequant_channel", "dequant_channel_numpy",
           "quantize_int8", "quantize_fp8_channel", "INT8", "FP8_CHANNEL", "INT8_NATIVE_ID", "FP8_CHANNEL_NATIVE_ID"]

INT8_MAX = 127  # the int8 quantizer's symmetric range [-127, 127] (a checkpoint's -128 reads as well)
INT8_NATIVE_ID, FP8_CHANNEL_NATIVE_ID = 7, 8  # native/weights.h
_SCALE = ".weight_scale"
_STRATEGIES = ("channel", "tensor")


@dataclasses.dataclass(frozen=True)
class _ChannelWeight:
    """Codes [.., out, in] and float32 `scale` [.., out, 1] (one per output channel)."""

    weight: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def dequantize(self) -> jax.Array:
        return dequant_channel(self.weight, self.scale)

    def nbytes(self) -> int:
        return int(self.weight.size * 1 + self.scale.size * 4)


@dataclasses.dataclass(frozen=True)
class Int8Weight(_ChannelWeight):
    """Int8 weight: int8 `weight` [.., out, in] and float32 `scale` [.., out, 1]."""

    format = "int8"


@dataclasses.dataclass(frozen=True)
class Fp8ChannelWeight(_ChannelWeight):
    """FP8 weight with a scale per output channel: float8_e4m3fn `weight` [.., out, in], float32 `scale`
    [.., out, 1]."""

    format = "fp8_channel"


for _cls in (Int8Weight, Fp8ChannelWeight):
    jax.tree_util.register_dataclass(_cls, data_fields=["weight", "scale"], meta_fields=[])


# ------------------------------------------------------------------------------------ values


def dequant_channel(weight: jax.Array, scale: jax.Array) -> jax.Array:
    """float32(weight[.., o, i]) * scale[.., o, 0]: float32 [.., out, in]."""
    return weight.astype(jnp.float32) * scale.astype(jnp.float32)


def dequant_channel_numpy(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """NumPy reference: codes [.., out, in] (int8 or float8_e4m3fn) * scale [.., out, 1] -> float32."""
    if tuple(scale.shape) != tuple(weight.shape[:-1]) + (1,):
        raise ValueError(f"weight_scale shape {tuple(scale.shape)} does not fit weight {tuple(weight.shape)} "
                         "(one scale per output channel: [out, 1])")
    return weight.astype(np.float32) * scale.astype(np.float32)


def _channel_scale(w: jax.Array, top: float) -> jax.Array:
    """amax(row) / top per output row, 1 for an all-zero row: float32 [.., out, 1]."""
    amax = jnp.max(jnp.abs(w), axis=-1, keepdims=True)
    return jnp.where(amax > 0, amax / top, 1.0).astype(jnp.float32)


def quantize_int8(w: jax.Array) -> Int8Weight:
    """float [.., out, in] -> Int8Weight: scale = amax(row) / 127, codes round(w / scale) (to nearest even)."""
    w = w.astype(jnp.float32)
    scale = _channel_scale(w, INT8_MAX)
    return Int8Weight(jnp.clip(jnp.round(w / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8), scale)


def quantize_fp8_channel(w: jax.Array) -> Fp8ChannelWeight:
    """float [.., out, in] -> Fp8ChannelWeight: scale = amax(row) / 448, codes e4m3(w / scale)."""
    w = w.astype(jnp.float32)
    scale = _channel_scale(w, FP8_MAX)
    return Fp8ChannelWeight(to_e4m3(w / scale), scale)


# ------------------------------------------------------------------------------- the two element types


@dataclasses.dataclass(frozen=True)
class _Element:
    """What differs between the element types: names, dtypes, the compressed-tensors convention, native id."""

    name: str
    container: type
    dtype: Any
    disk: str  # safetensors dtype code
    role: str
    ct_format: str  # compressed-tensors `format`
    ct_type: str  # compressed-tensors weights `type`
    native_id: int  # native/weights.h
    quantize: Any


_INT8 = _Element("int8", Int8Weight, jnp.int8, "I8", "int8", "int-quantized", "int", INT8_NATIVE_ID, quantize_int8)
_FP8 = _Element("fp8_channel", Fp8ChannelWeight, jnp.float8_e4m3fn, "F8_E4M3", "fp8", "float-quantized", "float",
                FP8_CHANNEL_NATIVE_ID, quantize_fp8_channel)


# ------------------------------------------------------------------------------- HF checkpoint


def _check_hf_config(e: _Element):
    want = {"num_bits": 8, "type": e.ct_type, "symmetric": True}

    def check_config(q: Mapping[str, Any]) -> None:
        """ValueError naming the key unless every config group quantizes weights as this format reads them."""
        if q.get("format") != e.ct_format:
            raise ValueError(f"quantization_config.format: expected {e.ct_format!r}, got {q.get('format')!r}")
        groups = q.get("config_groups")
        if not isinstance(groups, Mapping) or not groups:
            raise ValueError("quantization_config.config_groups: expected an object of one or more groups")
        for name, group in groups.items():
            where = f"quantization_config.config_groups.{name}"
            weights = group.get("weights") if isinstance(group, Mapping) else None
            if not isinstance(weights, Mapping):
                raise ValueError(f"{where}.weights: expected an object")
            for key, value in want.items():
                if weights.get(key) != value:
                    raise ValueError(f"{where}.weights.{key}: expected {value!r}, got {weights.get(key)!r}")
            if weights.get("strategy") not in _STRATEGIES:
                raise ValueError(f"{where}.weights.strategy: expected one of {_STRATEGIES}, got "
                                 f"{weights.get('strategy')!r}")
            if weights.get("dynamic"):
                raise ValueError(f"{where}.weights.dynamic: expected false (weights quantized on disk)")
            acts = group.get("input_activations")
            if acts is not None and not (isinstance(acts, Mapping) and acts.get("dynamic") is True):
                raise ValueError(f"{where}.input_activations: expected null or dynamic quantization (static "
                                 "activation scales are not supported)")
    return check_config


def _per_tensor(q: Mapping[str, Any]) -> bool:
    """Whether the config's weights have one scale per tensor (strategy 'tensor')."""
    groups = q.get("config_groups")
    groups = groups.values() if isinstance(groups, Mapping) else ()
    weights = [g.get("weights") for g in groups if isinstance(g, Mapping)]
    return any(isinstance(w, Mapping) and w.get("strategy") == "tensor" for w in weights)


def _disk_tensors(e: _Element):
    def disk_tensors(site: TensorSite, q: Mapping[str, Any]) -> list[DiskTensor] | None:
        base = site.name.removesuffix(".weight")
        if not site.linear or ignored(base, q):
            return None
        scale = (1,) if _per_tensor(q) else (site.shape[0], 1)
        return [DiskTensor(site.name, e.disk, site.shape, e.role),
                DiskTensor(base + _SCALE, "F32", scale, "channel_scale")]
    return disk_tensors


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


def _float32_scale(s: Any, rows: tuple[int, ...]) -> Any:
    """The scale as float32 [.., out, 1]: a per-tensor scale (one value) repeated for every channel."""
    shape = rows + (1,)
    if isinstance(s, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(shape, np.float32)
    s = np.asarray(s).astype(np.float32)
    return np.broadcast_to(s.reshape(-1)[0] if s.size == 1 else s, shape).copy()


def _from_parts(e: _Element):
    def from_parts(parts: WeightParts, arrays: Sequence[Any], q: Mapping[str, Any]) -> _ChannelWeight:
        w, s = arrays[:2]
        check(len(arrays) == 2, f"{e.name} weight_zero_point: asymmetric weights are not supported (expected "
                                "symmetric weights without a zero point)")
        check(jnp.dtype(w.dtype) == jnp.dtype(e.dtype), f"{e.name} weight must be {jnp.dtype(e.dtype).name}, "
                                                        f"got {w.dtype}")
        rows = tuple(w.shape[:-1])
        check(tuple(s.shape) == rows + (1,) or int(np.prod(s.shape)) == 1,
              f"weight_scale shape {tuple(s.shape)} does not fit weight {tuple(w.shape)} (one scale per output "
              "channel: [out, 1], or one per tensor)")
        return e.container(w, _float32_scale(s, rows))
    return from_parts


def _dequantize_numpy(parts: WeightParts, arrays: Sequence[np.ndarray], q: Mapping[str, Any]) -> np.ndarray:
    w, s = arrays[:2]
    return dequant_channel_numpy(w, _float32_scale(s, tuple(w.shape[:-1])) if np.size(s) == 1 else s)


def _native_args(e: _Element):
    def native_args(w: _ChannelWeight) -> tuple[int, jax.Array, jax.Array, jax.Array]:
        return e.native_id, w.weight, w.scale.astype(jnp.float32).reshape(w.scale.shape[:-1]), absent()
    return native_args


# ------------------------------------------------------------------------------- Pallas Triton


class _TritonTiles:
    """codes [G, N, K] (e4m3 as uint8 bit patterns when fp8_bits), scale float32 [G, N]."""

    num_refs = 2
    transposed = True

    def __init__(self, e4m3: bool, fp8_bits: bool):
        self.e4m3, self.fp8_bits = e4m3, fp8_bits

    def check_block_k(self, block_k: int) -> None:
        return None

    def tile(self, refs, g, k0, ks, ns, kmask, nmask, compute_dtype):
        w_ref, _ = refs
        index, mask = (g, row(ns), col(ks)), row(nmask) & col(kmask)
        if self.e4m3:
            return e4m3_load(w_ref, index, mask, self.fp8_bits).astype(compute_dtype)  # exact in bf16
        return plt.load(w_ref.at[index], mask=mask, other=0).astype(compute_dtype)  # int8 -> bf16: exact

    def step_scale(self, refs, g, k0, ns, nmask):
        _, s_ref = refs
        return plt.load(s_ref.at[g, ns], mask=nmask, other=0)

    def final_scale(self, refs, g):
        return None


def _triton(e: _Element):
    def triton(w: _ChannelWeight, num_groups: int, fp8_bits: bool):
        _, n_dim, k_dim = w.weight.shape
        if jnp.dtype(w.weight.dtype) != jnp.dtype(e.dtype):
            raise ValueError(f"{e.name} weight must be {jnp.dtype(e.dtype).name}, got {w.weight.dtype}")
        e4m3 = e is _FP8
        codes = fp8_operand(w.weight, fp8_bits) if e4m3 else w.weight
        return (_TritonTiles(e4m3, fp8_bits), (codes, w.scale.astype(jnp.float32).reshape(-1, n_dim)), n_dim,
                k_dim)
    return triton


# ------------------------------------------------------------------------------- Mosaic TPU


def _tpu_operands(x, w, num_groups, n_dim, k_dim, tm, tn):
    scale = jnp.swapaxes(w.scale.astype(jnp.float32), 1, 2)  # [G, 1, N]: the tile's scales along lanes
    specs = [rows_spec(tm, k_dim), weight_spec((tn, k_dim), 1), weight_spec((1, tn), 2)]
    return (x,), (w.weight, scale), specs


def _tpu_accumulator(w: _ChannelWeight):
    # int8 widens through int32 (the conversion Mosaic lowers on every TPU generation); e4m3 converts as it is
    widen = (lambda c: c.astype(jnp.int32).astype(jnp.float32)) if isinstance(w, Int8Weight) else (lambda c: c)

    def accumulate(refs, expert, *, tm, tn, k_dim, compute_dtype, precision):
        """(sum over 512-column chunks c of x[:, c] . codes[:, c].T) * scale[n]: [tm, tn] float32."""
        x_ref, w_ref, s_ref = refs
        acc = jnp.zeros((tm, tn), jnp.float32)
        for c0 in range(0, k_dim, CHUNK_K):
            c1 = min(c0 + CHUNK_K, k_dim)
            wc = widen(w_ref[:, c0:c1]).astype(compute_dtype)  # exact in bf16
            acc = acc + dot_nt(x_ref[:, c0:c1].astype(compute_dtype), wc, precision)
        return acc * s_ref[...]
    return accumulate


def _tpu_vmem(tm: int, tn: int, k_dim: int) -> tuple[int, int, int]:
    weight = round_up(tn, 32) * round_up(k_dim, 128)
    scale = 8 * round_up(tn, 128) * 4
    return weight, scale, 3 * tn * CHUNK_K * 4  # one chunk as int32, float32 and the compute dtype


def _tpu_check(e: _Element):
    def tpu_check(w: _ChannelWeight) -> None:
        if jnp.dtype(w.weight.dtype) != jnp.dtype(e.dtype):
            raise NotSupported(f"{e.name} weights must be {jnp.dtype(e.dtype).name}, got {w.weight.dtype}")
    return tpu_check


def _format(e: _Element) -> QuantFormat:
    return QuantFormat(
        name=e.name, container=e.container, hf_methods=(_CT,), hf_formats=(e.ct_format,),
        check_hf_config=_check_hf_config(e),
        roles={e.role: (e.disk,), "channel_scale": ("F32", "BF16", "F16")}, disk_tensors=_disk_tensors(e),
        find_parts=_find_parts, from_parts=_from_parts(e), dequantize_numpy=_dequantize_numpy,
        byte_nonfinite=lambda name: None, quantize=e.quantize,
        native_args=_native_args(e), native_int8=False, triton=_triton(e),
        tpu=TpuTiles(operands=_tpu_operands, accumulator=_tpu_accumulator, vmem=_tpu_vmem, check=_tpu_check(e)))


INT8, FP8_CHANNEL = _format(_INT8), _format(_FP8)
