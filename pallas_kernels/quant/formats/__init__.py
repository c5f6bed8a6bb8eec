"""Quantized weight formats (modules `fp8_block`, `mxfp4`, `nvfp4`, `channel`: `int8` and `fp8_channel`), each a
`QuantFormat` record: the container, its JAX and NumPy dequantizers, the quantizer, the HF checkpoint names, the
native CPU format id, and the Triton and Mosaic TPU weight-tile code (see `_record.py`).

| container      | element                                   | scale                                            | dequant                          |
|----------------|-------------------------------------------|--------------------------------------------------|----------------------------------|
| Fp8BlockWeight | float8_e4m3fn weight [.., out, in]        | float32 scale_inv [.., ceil(out/128), ceil(in/128)] | w * scale_inv (a multiplier)  |
| Mxfp4Weight    | uint8 blocks [.., out, in/32, 16] (E2M1)  | uint8 E8M0 scales [.., out, in/32], UNSIGNED     | LUT[nibble] * 2**(s - 127)       |
| Nvfp4Weight    | uint8 packed [.., out, in/2] (E2M1)       | e4m3 scale [.., out, in/16], f32 global [.., 1]  | LUT[nibble] * (scale / global)   |
| Int8Weight     | int8 weight [.., out, in]                 | float32 scale [.., out, 1] (per output channel)  | w * scale                        |
| Fp8ChannelWeight | float8_e4m3fn [.., out, in]             | float32 scale [.., out, 1] (per output channel)  | w * scale                        |

A weight is stored [out, in] (HF layout: y = x @ W.T), optionally with leading expert dims [..., out, in]. The
reference dequantizers are float32 and bit-identical to the NumPy formulas of the fixtures README. Adding a
format: one module that builds a `QuantFormat`, and one entry in `FORMATS` below.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from ._bits import E2M1_LUT, FP8_MAX, e2m1_to_f32, e4m3_to_f32, e8m0_to_f32, unpack_fp4
from ._record import DiskTensor, QuantFormat, TensorSite, TpuTiles, WeightParts, absent
from ._fp8_block import FP8_BLOCK, Fp8BlockWeight, dequant_fp8_block, quantize_fp8_block
from ._mxfp4 import MXFP4_BLOCK, Mxfp4Weight, dequant_mxfp4, quantize_mxfp4
from ._nvfp4 import NVFP4_BLOCK, Nvfp4Weight, dequant_nvfp4, quantize_nvfp4
from ._channel import Fp8ChannelWeight, Int8Weight, dequant_channel, quantize_fp8_channel, quantize_int8
from ._compressed_tensors import METHOD as COMPRESSED_TENSORS
from ._tpu_tiles import round_up
from . import _channel as channel, _fp8_block as fp8_block, _mxfp4 as mxfp4, _nvfp4 as nvfp4

__all__ = ["round_up", "FORMATS", "QuantFormat", "DiskTensor", "WeightParts", "TensorSite", "TpuTiles", "absent",
           "format_of", "format_for_config", "E2M1_LUT", "FP8_MAX", "FP8_BLOCK", "MXFP4_BLOCK", "NVFP4_BLOCK",
           "Fp8BlockWeight", "Mxfp4Weight", "Nvfp4Weight", "Int8Weight", "Fp8ChannelWeight", "QuantizedWeight",
           "dequant_fp8_block", "dequant_mxfp4", "dequant_nvfp4", "dequant_channel", "quantize_fp8_block",
           "quantize_mxfp4", "quantize_nvfp4", "quantize_int8", "quantize_fp8_channel", "e2m1_to_f32", "e8m0_to_f32",
           "e4m3_to_f32", "unpack_fp4", "weight_bytes"]

#: every format by name, in registration order
FORMATS: dict[str, QuantFormat] = {f.name: f for f in (fp8_block.FORMAT, mxfp4.FORMAT, nvfp4.FORMAT, channel.INT8,
                                                       channel.FP8_CHANNEL)}
_BY_CONTAINER = {f.container: f for f in FORMATS.values()}


def _config_keys(f: QuantFormat):
    """(quant_method, compressed-tensors `format` or None) of each config.json convention the format reads."""
    for method in f.hf_methods:
        yield from ((method, name) for name in f.hf_formats) if method == COMPRESSED_TENSORS else [(method, None)]


_BY_METHOD = {key: f for f in FORMATS.values() for key in _config_keys(f)}
_BY_METHOD[(COMPRESSED_TENSORS, None)] = nvfp4.FORMAT  # compressed-tensors without `format`: NVFP4 as ever

QuantizedWeight = Fp8BlockWeight | Mxfp4Weight | Nvfp4Weight | Int8Weight | Fp8ChannelWeight


def format_of(w: Any) -> QuantFormat | None:
    """The format of a container, or None for anything else (a plain array)."""
    return _BY_CONTAINER.get(type(w))


def format_for_config(q: Any) -> QuantFormat | None:
    """The format a config.json `quantization_config` names: its `quant_method`, and for compressed-tensors its
    `format` too; None for another method. ValueError (naming `format`) for a compressed-tensors format that no
    format reads."""
    method = q.get("quant_method") if isinstance(q, Mapping) else None
    if not isinstance(method, str):
        return None
    name = q.get("format") if method == COMPRESSED_TENSORS else None
    fmt = _BY_METHOD.get((method, name)) if name is None or isinstance(name, str) else None
    if fmt is None and method == COMPRESSED_TENSORS:
        known = sorted(n for m, n in _BY_METHOD if m == COMPRESSED_TENSORS and n is not None)
        raise ValueError(f"quantization_config.format: unsupported compressed-tensors format {name!r} "
                         f"(supported: {', '.join(known)})")
    return fmt


def weight_bytes(w: Any) -> int:
    """Bytes a kernel must read for weight `w` (quantized container or array)."""
    if format_of(w) is not None:
        return w.nbytes()
    return int(w.size * jnp.dtype(w.dtype).itemsize)
