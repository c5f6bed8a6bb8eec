"""One dense projection for every layer that has one: `linear(x, w, b, impl)` with a float kernel [in, out] or a
quantized container of the on-disk [out, in] weight, through XLA or, for a few rows on CPU, the native kernel
(`native.dense`: each weight byte read once, packed formats decoded in registers)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ..quant import weights as quant_weights
from ..native.dense import dense, worth_it

__all__ = ["DENSE_IMPLS", "check_dense_impl", "linear"]

DENSE_IMPLS = ("auto", "xla", "native")


def check_dense_impl(impl: str) -> str:
    if impl not in DENSE_IMPLS:
        raise ValueError(f"dense_impl must be one of {DENSE_IMPLS}, got {impl!r}")
    return impl


def linear(x: jax.Array, w: Any, b: jax.Array | None = None, impl: str = "auto") -> jax.Array:
    """x [..., in] @ w (+ b [out]) -> [..., out] in x's dtype: w a float kernel [in, out], or a quantized container
    of the on-disk [out, in] weight.

    impl: 'xla' (a matmul; packed weights dequantized inside it, see `tutel_jax.quant.weights`), 'native' (the
    C++ CPU kernel `native.dense`: each weight byte read once, packed formats decoded in registers, float32
    accumulation) or 'auto': 'native' on CPU for at most `native.dense.MAX_ROWS` rows (decode) of a bfloat16 or
    packed weight when the kernel can be built, else 'xla'."""
    if impl == "native" or (impl == "auto" and worth_it(x, w)):
        return dense(x, w, b).astype(x.dtype)
    y = quant_weights.dense(x, w) if quant_weights.is_quantized(w) else jnp.matmul(x, w)
    return y if b is None else y + b
