"""`from_pretrained` arguments that keep float32 activations on CPU.

On CPU the default ('auto') multiplies FP4 (MXFP4, NVFP4) weights by int8 activations (`native_int8`: llama.cpp's
Q8_0, about 1e-2 of the outputs' scale; tests/native/test_native_q8.py). Tests that compare an FP4 model with
transformers or with its dequantized float twin at 1e-5 ask for the float32 native paths instead, where the
kernels can be built (else 'auto' is the XLA path, float32 already).
"""

from __future__ import annotations

from tutel_jax.native import _build as build

#: dropless_impl / dense_impl for float32 activations (empty: no C++ compiler, 'auto' is float32 there)
FLOAT_ACTIVATIONS: dict[str, str] = (
    {"dropless_impl": "native", "dense_impl": "native"} if build.compiler() is not None else {})
