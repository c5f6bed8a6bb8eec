"""A quantized HF checkpoint's tensors under their unquantized names (formats: `pallas_kernels.quant.formats`,
one module each with its on-disk names and NumPy reference).

`DequantizedTensors(tensors, config)` is a Mapping that shows the float32 tensors under the unquantized names
(each format's `dequantize_numpy`, in the float checkpoint's layout: GPT-OSS's MXFP4 expert weights as
[E, in, out]), so the float loaders (`hf_tables`, `moe_block`) read quantized checkpoints unchanged; other
floating tensors (bf16, f16) are upcast to float32 exactly. That is the reference path. The default
`QuantizedTensors(tensors, config)` shows the same names as the formats' containers of the packed arrays,
validated (`from_parts`), dequantized inside the matmuls (`tutel_jax.quant._weights`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from pallas_kernels.quant import FORMATS, QuantFormat, format_for_config
from pallas_kernels.quant.formats import WeightParts

__all__ = ["QUANT_METHODS", "DequantizedTensors", "QuantizedTensors", "check_quantization_config", "is_quantized"]

#: config.json quant_method values with a format (`pallas_kernels.quant.FORMATS`)
QUANT_METHODS = tuple(method for fmt in FORMATS.values() for method in fmt.hf_methods)


def _is_float(dtype: np.dtype) -> bool:
    """NumPy floats and ml_dtypes floats (bfloat16, float8_*), whose dtype kind is not 'f'."""
    return np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16" or dtype.name.startswith("float8")


def is_quantized(config: Mapping[str, Any]) -> bool:
    return bool(config.get("quantization_config"))


def check_quantization_config(config: Mapping[str, Any]) -> None:
    """ValueError unless config.json's quantization_config names a supported method (and its format's options)."""
    q = config.get("quantization_config")
    if not q:
        return
    if not isinstance(q, Mapping):
        raise ValueError(f"quantization_config must be an object, got {type(q).__name__}")
    fmt = format_for_config(q)
    if fmt is None:
        raise ValueError(f"unsupported quantization method {q.get('quant_method')!r}; supported: {QUANT_METHODS}")
    fmt.check_hf_config(q)


def _array(value: Any) -> Any:
    """A tensor as NumPy; an abstract one (ShapeDtypeStruct: compiling without weights) as it is."""
    return value if isinstance(value, jax.ShapeDtypeStruct) else np.asarray(value)


class _QuantizedCheckpointView(Mapping):
    """A checkpoint's tensors by unquantized name: the parts of each quantized weight (module docstring) are
    hidden behind its base name, which `_convert` turns into a value; other tensors go through `_plain`."""

    def __init__(self, tensors: Mapping[str, np.ndarray], config: Mapping[str, Any] | None = None):
        self._t = tensors
        self._q = (config or {}).get("quantization_config") or {}
        self._rules: dict[str, tuple[QuantFormat, WeightParts]] = {}
        hidden = set()
        # the config's format (int8 and FP8 per channel share their tensor names), else every format's names
        named = format_for_config(self._q) if self._q else None
        formats = [named] if named is not None else list(FORMATS.values())
        for name in tensors:
            for fmt in formats:
                parts = fmt.find_parts(name, tensors)
                if parts is not None:
                    self._rules[parts.base] = (fmt, parts)
                    hidden.update(parts.hidden)
                    break
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
            return self._plain(_array(self._t[name]))
        fmt, parts = rule
        arrays = [_array(self._t[p]) for p in parts.names]  # read errors (e.g. non-finite) pass through as is
        try:
            return self._convert(fmt, parts, arrays)
        except ValueError as e:
            raise ValueError(f"tensor {name!r}: {e}") from None

    def _plain(self, a: np.ndarray) -> np.ndarray:
        return a

    def _convert(self, fmt: QuantFormat, parts: WeightParts, arrays: list[np.ndarray]) -> Any:
        raise NotImplementedError


class DequantizedTensors(_QuantizedCheckpointView):
    """Float32 view of a checkpoint's tensors by unquantized name (see module docstring); lazy per tensor.
    The reference path: `from_pretrained(..., dequantize=True)`."""

    def _plain(self, a):
        return a.astype(np.float32) if _is_float(a.dtype) else a

    def _convert(self, fmt, parts, arrays):
        return fmt.dequantize_numpy(parts, arrays, self._q)


class QuantizedTensors(_QuantizedCheckpointView):
    """View whose quantized weights are `pallas_kernels.quant` containers of the packed NumPy arrays, in the
    checkpoint's own layout (FP8 / NVFP4 [out, in]; MXFP4 [E, out, in]); shapes are validated here. Other
    tensors are returned as stored. FP8 needs 128 x 128 blocks (`fp8_block_supported`)."""

    def _convert(self, fmt, parts, arrays):
        return fmt.from_parts(parts, arrays, self._q)

    def fp8_block_supported(self) -> bool:
        return tuple(self._q.get("weight_block_size") or (128, 128)) == (128, 128)
