"""Dequantize-on-load view of a quantized HF checkpoint (formats: see pallas_kernels/quant/formats.py).

`DequantizedTensors(tensors, config)` is a Mapping that shows the float32 tensors under the unquantized names,
so the float loaders (`hf_tables`, `moe_block`) read quantized checkpoints unchanged;
`QuantizedTensors(tensors, config)` shows the same names as quantized containers:

  FP8 block (DeepSeek)    X.weight e4m3 [out, in] + X.weight_scale_inv f32 [ceil(out/b), ceil(in/b)]
                          -> X.weight = f32(w) * scale_inv per b x b block (edge blocks partial)
  MXFP4 (GPT-OSS)         X_blocks u8 [E, out, in/32, 16] + X_scales u8 E8M0 [E, out, in/32]
                          -> X = (LUT[nibbles] * 2**(s - 127)) [E, out, in], transposed to [E, in, out]
  NVFP4 (compressed-t.)   X.weight_packed u8 [out, in/2] + X.weight_scale e4m3 [out, in/16] + X.weight_global_scale
                          -> X.weight = LUT[nibbles] * (f32(weight_scale) / weight_global_scale)
  NVFP4 (ModelOpt)        X.weight u8 [out, in/2] + X.weight_scale e4m3 [out, in/16] + X.weight_scale_2 f32 []
                          -> X.weight = LUT[nibbles] * (f32(weight_scale) * weight_scale_2)  (X.input_scale unused)
Other floating tensors (bf16, f16) are upcast to float32 exactly. That is the reference path; the default
`QuantizedTensors` view keeps the weights packed (containers of `pallas_kernels.quant`), dequantized inside the
matmuls (`tutel_jax.quant.weights`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from pallas_kernels.quant import E2M1_LUT, Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight

__all__ = ["E2M1_LUT", "QUANT_METHODS", "DequantizedTensors", "QuantizedTensors", "check_quantization_config", "dequant_fp8_block", "dequant_mxfp4", "dequant_nvfp4",
           "is_quantized"]

def _is_float(dtype: np.dtype) -> bool:
    """NumPy floats and ml_dtypes floats (bfloat16, float8_*), whose dtype kind is not 'f'."""
    return np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16" or dtype.name.startswith("float8")


def is_quantized(config: Mapping[str, Any]) -> bool:
    return bool(config.get("quantization_config"))


QUANT_METHODS = ("fp8", "mxfp4", "compressed-tensors", "modelopt")


def check_quantization_config(config: Mapping[str, Any]) -> None:
    """ValueError unless config.json's quantization_config names a supported method / format."""
    q = config.get("quantization_config")
    if not q:
        return
    if not isinstance(q, Mapping):
        raise ValueError(f"quantization_config must be an object, got {type(q).__name__}")
    method = q.get("quant_method")
    if method not in QUANT_METHODS:
        raise ValueError(f"unsupported quantization method {method!r}; supported: {QUANT_METHODS}")
    fmt = q.get("format")
    if method == "compressed-tensors" and fmt not in (None, "nvfp4-pack-quantized"):
        raise ValueError(f"unsupported compressed-tensors format {fmt!r}; supported: 'nvfp4-pack-quantized'")
    if method == "modelopt" and str(q.get("quant_algo", "")).upper() != "NVFP4":
        raise ValueError(f"unsupported modelopt quant_algo {q.get('quant_algo')!r}; supported: 'NVFP4'")


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


def dequant_nvfp4(packed: np.ndarray, scale: np.ndarray, global_scale: np.ndarray, group: int = 16,
                  global_multiplies: bool = False) -> np.ndarray:
    """packed u8 [out, in/2], scale e4m3 [out, in/group], global_scale f32 [1] -> float32 [out, in]; the global
    scale divides (compressed-tensors) or multiplies (`global_multiplies`: ModelOpt's weight_scale_2)."""
    vals = E2M1_LUT[_nibbles(packed)]
    g = np.asarray(global_scale, np.float32).reshape(())
    s = scale.astype(np.float32) * g if global_multiplies else scale.astype(np.float32) / g
    return vals * np.repeat(s, group, axis=-1)[:, :vals.shape[-1]]


class _QuantizedCheckpointView(Mapping):
    """A checkpoint's tensors by unquantized name: the parts of each quantized weight (module docstring) are
    hidden behind its base name, which `_convert` turns into a value; other tensors go through `_plain`."""

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
            elif name.endswith(".weight_scale_2"):  # ModelOpt NVFP4: X.weight u8, X.weight_scale, X.weight_scale_2
                base = name[: -len("_scale_2")]
                parts = (base, base + "_scale", name)
                missing = [p for p in parts if p not in tensors]
                if missing:
                    raise ValueError(f"NVFP4 (ModelOpt) tensor {name!r} lacks {missing}")
                self._rules[base] = ("nvfp4_modelopt", parts)
                hidden.update(parts[1:] + (base[: -len("weight")] + "input_scale",))
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

    def quantized_names(self) -> list[str]:
        """Base names of the quantized weights."""
        return list(self._rules)

    def __getitem__(self, name: str) -> Any:
        rule = self._rules.get(name)
        if rule is None:
            if name not in self:
                raise KeyError(name)
            return self._plain(np.asarray(self._t[name]))
        fmt, parts = rule
        arrays = [np.asarray(self._t[p]) for p in parts]  # read errors (e.g. non-finite) pass through as they are
        try:
            return self._convert(fmt, arrays)
        except ValueError as e:
            raise ValueError(f"tensor {name!r}: {e}") from None

    def _plain(self, a: np.ndarray) -> np.ndarray:
        return a

    def _convert(self, fmt: str, parts: list[np.ndarray]) -> Any:
        raise NotImplementedError


class DequantizedTensors(_QuantizedCheckpointView):
    """Float32 view of a checkpoint's tensors by unquantized name (see module docstring); lazy per tensor.
    The reference path: `from_pretrained(..., dequantize=True)`."""

    def _plain(self, a):
        return a.astype(np.float32) if _is_float(a.dtype) else a

    def _convert(self, fmt, a):
        if fmt == "fp8":
            return dequant_fp8_block(a[0], a[1], self._block)
        if fmt == "mxfp4":
            return np.swapaxes(dequant_mxfp4(a[0], a[1]), -1, -2).copy()  # [E, out, in] -> [E, in, out]
        return dequant_nvfp4(a[0], a[1], a[2], global_multiplies=fmt == "nvfp4_modelopt")


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


class QuantizedTensors(_QuantizedCheckpointView):
    """View whose quantized weights are `pallas_kernels.quant` containers of the packed NumPy arrays, in the
    checkpoint's own layout (FP8 / NVFP4 [out, in]; MXFP4 [E, out, in]); shapes are validated here. Other
    tensors are returned as stored. FP8 needs 128 x 128 blocks (`fp8_block_supported`)."""

    def _convert(self, fmt, a):
        if fmt == "fp8":
            w, s = a
            _expect(w.dtype.name == "float8_e4m3fn", f"FP8 weight must be float8_e4m3fn, got {w.dtype}")
            want = w.shape[:-2] + tuple(-(-d // 128) for d in w.shape[-2:])
            _expect(s.shape == want, f"weight_scale_inv shape {s.shape} does not fit weight {w.shape} in "
                                     "128x128 blocks")
            return Fp8BlockWeight(w, s.astype(np.float32))
        if fmt == "mxfp4":
            blocks, scales = a
            _expect(blocks.dtype == np.uint8 and scales.dtype == np.uint8, "MXFP4 blocks/scales must be uint8")
            _expect(blocks.ndim >= 3 and blocks.shape[-1] == 16 and scales.shape == blocks.shape[:-1],
                    f"MXFP4 blocks {blocks.shape} must be [..., G, 16] with scales [..., G], got scales "
                    f"{scales.shape}")
            return Mxfp4Weight(blocks, scales)
        packed, scale, gscale = a
        _expect(packed.dtype == np.uint8, f"NVFP4 packed weight must be uint8, got {packed.dtype}")
        _expect(scale.shape == packed.shape[:-1] + (packed.shape[-1] * 2 // 16,),
                f"NVFP4 weight_scale shape {scale.shape} does not fit weight_packed {packed.shape} "
                "(one scale per 16 values)")
        _expect(gscale.size == 1, f"NVFP4 weight_global_scale must hold one value, got shape {gscale.shape}")
        return Nvfp4Weight(packed, scale, gscale.astype(np.float32).reshape(1), fmt == "nvfp4_modelopt")

    def fp8_block_supported(self) -> bool:
        return self._block == (128, 128)
