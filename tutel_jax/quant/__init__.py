"""Quantized weights (FP8 block, MXFP4, NVFP4, per-channel int8 / FP8): `pallas_kernels.quant` containers as the
library holds them, and the dense matmul, dequantization and quantization over them (`weights`)."""

from ._weights import (FORMATS, check_format, dense, dequantize, is_quantized, quantize, logical_shape,
                       resident_bytes, stack, to_jax)

__all__ = ["logical_shape", "resident_bytes", "stack", "to_jax", "FORMATS", "check_format", "dense", "dequantize",
           "is_quantized", "quantize"]
