"""Quantized weight formats, one module each (`fp8_block`, `mxfp4`, `nvfp4`), each a `QuantFormat` record:
the container, its JAX and NumPy dequantizers, the quantizer, the HF checkpoint names, the native CPU format id,
and the Triton and Mosaic TPU weight-tile code (see `_record.py`).

| container      | element                                   | scale                                            | dequant                          |
|----------------|-------------------------------------------|--------------------------------------------------|----------------------------------|
| Fp8BlockWeight | float8_e4m3fn weight [.., out, in]        | float32 scale_inv [.., ceil(out/128), ceil(in/128)] | w * scale_inv (a multiplier)  |
| Mxfp4Weight    | uint8 blocks [.., out, in/32, 16] (E2M1)  | uint8 E8M0 scales [.., out, in/32], UNSIGNED     | LUT[nibble] * 2**(s - 127)       |
| Nvfp4Weight    | uint8 packed [.., out, in/2] (E2M1)       | e4m3 scale [.., out, in/16], f32 global [.., 1]  | LUT[nibble] * (scale / global)   |

A weight is stored [out, in] (HF layout: y = x @ W.T), optionally with leading expert dims [..., out, in]. The
reference dequantizers are float32 and bit-identical to the NumPy formulas of the fixtures README. Adding a
format: one module that builds a `QuantFormat`, and one entry in `FORMATS` below.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from ._bits import E2M1_LUT, FP8_MAX, e2m1_to_f32, e4m3_to_f32, e8m0_to_f32, unpack_fp4
from ._record import DiskTensor, QuantFormat, TensorSite, TpuTiles, WeightParts, absent
from ._fp8_block import FP8_BLOCK, Fp8BlockWeight, dequant_fp8_block, quantize_fp8_block
from ._mxfp4 import MXFP4_BLOCK, Mxfp4Weight, dequant_mxfp4, quantize_mxfp4
from ._nvfp4 import NVFP4_BLOCK, Nvfp4Weight, dequant_nvfp4, quantize_nvfp4
from ._tpu_tiles import round_up
from . import _fp8_block as fp8_block, _mxfp4 as mxfp4, _nvfp4 as nvfp4

__all__ = ["round_up", "FORMATS", "QuantFormat", "DiskTensor", "WeightParts", "TensorSite", "TpuTiles", "absent",
           "format_of", "format_for_method", "E2M1_LUT", "FP8_MAX", "FP8_BLOCK", "MXFP4_BLOCK", "NVFP4_BLOCK",
           "Fp8BlockWeight", "Mxfp4Weight", "Nvfp4Weight", "QuantizedWeight", "dequant_fp8_block", "dequant_mxfp4",
           "dequant_nvfp4", "quantize_fp8_block", "quantize_mxfp4", "quantize_nvfp4", "e2m1_to_f32", "e8m0_to_f32",
           "e4m3_to_f32", "unpack_fp4", "weight_bytes"]

#: every format by name, in registration order
FORMATS: dict[str, QuantFormat] = {f.name: f for f in (fp8_block.FORMAT, mxfp4.FORMAT, nvfp4.FORMAT)}
_BY_CONTAINER = {f.container: f for f in FORMATS.values()}
_BY_METHOD = {method: f for f in FORMATS.values() for method in f.hf_methods}

QuantizedWeight = Fp8BlockWeight | Mxfp4Weight | Nvfp4Weight


def format_of(w: Any) -> QuantFormat | None:
    """The format of a container, or None for anything else (a plain array)."""
    return _BY_CONTAINER.get(type(w))


def format_for_method(quant_method: Any) -> QuantFormat | None:
    """The format a config.json `quantization_config.quant_method` names, or None."""
    return _BY_METHOD.get(quant_method) if isinstance(quant_method, str) else None


def weight_bytes(w: Any) -> int:
    """Bytes a kernel must read for weight `w` (quantized container or array)."""
    if format_of(w) is not None:
        return w.nbytes()
    return int(w.size * jnp.dtype(w.dtype).itemsize)
