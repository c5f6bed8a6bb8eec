"""Dequantize-on-load view of a quantized HF checkpoint (formats: see pallas_kernels/quant.py).

`DequantizedTensors(tensors, config)` is a Mapping that shows the float32 tensors under the unquantized names,
so the float loaders (`hf_tables`, `checkpoint.hf_moe`) read quantized checkpoints unchanged:

  FP8 block (DeepSeek)    X.weight e4m3 [out, in] + X.weight_scale_inv f32 [ceil(out/b), ceil(in/b)]
                          -> X.weight = f32(w) * scale_inv per b x b block (edge blocks partial)
  MXFP4 (GPT-OSS)         X_blocks u8 [E, out, in/32, 16] + X_scales u8 E8M0 [E, out, in/32]
                          -> X = (LUT[nibbles] * 2**(s - 127)) [E, out, in], transposed to [E, in, out]
  NVFP4 (compressed-t.)   X.weight_packed u8 [out, in/2] + X.weight_scale e4m3 [out, in/16] + X.weight_global_scale
                          -> X.weight = LUT[nibbles] * (f32(weight_scale) / weight_global_scale)
Other floating tensors (bf16, f16) are upcast to float32 exactly. Weights are NOT kept quantized here: this is
the reference path; kept-quantized weights with in-kernel dequantization are future work.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["E2M1_LUT", "DequantizedTensors", "dequant_fp8_block", "dequant_mxfp4", "dequant_nvfp4",
           "is_quantized"]

E2M1_LUT = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _is_float(dtype: np.dtype) -> bool:
    """NumPy floats and ml_dtypes floats (bfloat16, float8_*), whose dtype kind is not 'f'."""
    return dtype.kind == "f" or dtype.name == "bfloat16" or dtype.name.startswith("float8")


def is_quantized(config: Mapping[str, Any]) -> bool:
    return bool(config.get("quantization_config"))


def dequant_fp8_block(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = (128, 128)) -> np.ndarray:
    """w [out, in] (float8) * scale_inv [ceil(out/b0), ceil(in/b1)] per block -> float32 [out, in]."""
    out, inp = w.shape
    if scale_inv.shape != (-(-out // block[0]), -(-inp // block[1])):
        raise ValueError(f"weight_scale_inv shape {scale_inv.shape} does not fit weight {w.shape} in "
                         f"{block[0]}x{block[1]} blocks")
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), block[0], 0), block[1], 1)[:out, :inp]
    return w.astype(np.float32) * s


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., n] -> codes [..., 2n], low nibble first."""
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (-1,))


def dequant_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks u8 [..., G, 16], scales u8 [..., G] (E8M0, unsigned) -> float32 [..., 32 G]."""
    vals = E2M1_LUT[_nibbles(blocks)]  # [..., G, 32]
    vals = np.ldexp(vals, scales.astype(np.int32)[..., None] - 127).astype(np.float32)
    return vals.reshape(vals.shape[:-2] + (-1,))


def dequant_nvfp4(packed: np.ndarray, scale: np.ndarray, global_scale: np.ndarray, group: int = 16) -> np.ndarray:
    """packed u8 [out, in/2], scale e4m3 [out, in/group], global_scale f32 [1] -> float32 [out, in]."""
    vals = E2M1_LUT[_nibbles(packed)]
    s = scale.astype(np.float32) / np.asarray(global_scale, np.float32).reshape(())
    return vals * np.repeat(s, group, axis=-1)[:, :vals.shape[-1]]


class DequantizedTensors(Mapping):
    """Float32 view of a checkpoint's tensors by unquantized name (see module docstring); lazy per tensor."""

    def __init__(self, tensors: Mapping[str, np.ndarray], config: Mapping[str, Any] | None = None):
        self._t = tensors
        q = (config or {}).get("quantization_config") or {}
        self._block = tuple(q.get("weight_block_size") or (128, 128))
        self._rules: dict[str, tuple[str, tuple[str, ...]]] = {}
        hidden = set()
        for name in tensors:
            if name.endswith(".weight_scale_inv"):
                base = name[: -len("_scale_inv")]
                self._rules[base] = ("fp8", (base, name))
                hidden.add(name)
            elif name.endswith("_blocks") and name[: -len("_blocks")] + "_scales" in tensors:
                base = name[: -len("_blocks")]
                self._rules[base] = ("mxfp4", (name, base + "_scales"))
                hidden.update((name, base + "_scales"))
            elif name.endswith(".weight_packed"):
                base = name[: -len("_packed")]
                parts = (name, base + "_scale", base + "_global_scale")
                missing = [p for p in parts if p not in tensors]
                if missing:
                    raise ValueError(f"NVFP4 tensor {name!r} lacks {missing}")
                self._rules[base] = ("nvfp4", parts)
                hidden.update(parts)
        self._names = [n for n in tensors if n not in hidden and n not in self._rules] + list(self._rules)
        self._visible = frozenset(self._names)

    def __contains__(self, name) -> bool:
        return name in self._visible

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __getitem__(self, name: str) -> np.ndarray:
        rule = self._rules.get(name)
        if rule is None:
            if name not in self:
                raise KeyError(name)
            a = np.asarray(self._t[name])
            return a.astype(np.float32) if _is_float(a.dtype) else a
        kind, parts = rule
        a = [np.asarray(self._t[p]) for p in parts]
        try:
            if kind == "fp8":
                return dequant_fp8_block(a[0], a[1], self._block)
            if kind == "mxfp4":
                return np.swapaxes(dequant_mxfp4(a[0], a[1]), -1, -2).copy()  # [E, out, in] -> [E, in, out]
            return dequant_nvfp4(a[0], a[1], a[2])
        except ValueError as e:
            raise ValueError(f"tensor {name!r}: {e}") from None
