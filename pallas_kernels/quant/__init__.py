"""Quantized matmul: activations x FP8-block / MXFP4 / NVFP4 / int8 / per-channel FP8 weights, dequantized inside
the kernel.

| file | what |
|---|---|
| formats/ | one module per weight format (`fp8_block`, `mxfp4`, `nvfp4`, `channel`): container, dequantizers, |
|  | quantizer, HF names, native format id, tile loaders |
| _reference.py | the semantics in plain JAX, the reference every backend equals |
| _api.py | `quant_matmul` / `quant_gmm`: backend choice |
| _pallas_triton.py | the grouped-matmul Triton kernel running the format's weight-tile loader, tilings per target |
| _pallas_mosaic_tpu.py | a Mosaic kernel that dequantizes in VMEM (TPU), with the format's tile code |
"""

from ._api import quant_gmm, quant_matmul
from .formats import (FORMATS, E2M1_LUT, FP8_BLOCK, FP8_MAX, MXFP4_BLOCK, NVFP4_BLOCK, Fp8BlockWeight, Fp8ChannelWeight,
                      Int8Weight, Mxfp4Weight, Nvfp4Weight, QuantizedWeight, dequant_channel, dequant_fp8_block,
                      dequant_mxfp4, dequant_nvfp4, e2m1_to_f32, e4m3_to_f32, e8m0_to_f32, quantize_fp8_block,
                      quantize_fp8_channel, quantize_int8, quantize_mxfp4, quantize_nvfp4, unpack_fp4, weight_bytes,
                      format_of, format_for_config, QuantFormat)
from ._pallas_triton import DECODE_ROWS, QUANT_TILINGS, QuantMatmulConfig, default_quant_config, tiling_candidates
from ._reference import quant_gmm_reference, quant_matmul_reference

__all__ = ["FORMATS", "QuantFormat", "format_of", "format_for_config", "quant_matmul", "quant_gmm",
           "quant_matmul_reference", "quant_gmm_reference", "E2M1_LUT", "FP8_MAX", "FP8_BLOCK", "MXFP4_BLOCK",
           "NVFP4_BLOCK", "Fp8BlockWeight", "Mxfp4Weight", "Nvfp4Weight", "Int8Weight", "Fp8ChannelWeight",
           "QuantizedWeight", "dequant_fp8_block", "dequant_mxfp4", "dequant_nvfp4", "dequant_channel",
           "quantize_fp8_block", "quantize_mxfp4", "quantize_nvfp4", "quantize_int8", "quantize_fp8_channel",
           "e2m1_to_f32",
           "e8m0_to_f32", "e4m3_to_f32", "unpack_fp4", "weight_bytes", "QuantMatmulConfig", "QUANT_TILINGS",
           "DECODE_ROWS", "default_quant_config", "tiling_candidates"]
