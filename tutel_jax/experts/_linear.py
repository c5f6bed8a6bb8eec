"""One dense projection for every layer that has one: `linear(x, w, b, impl)` with the weight [out, in] as a
checkpoint stores it, float or a quantized container (one layout, one call), through XLA or, for a few rows on
CPU, the native kernel (`native.dense`: each weight row read once, contiguously; packed formats decoded in
registers)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .. import quant
from ..native import CompactBf16, dense, worth_it, int8_by_default
from ..validation import check_choice

__all__ = ["DENSE_IMPLS", "check_dense_impl", "head_linear", "linear", "matmul_out_in", "native_activations",
           "xla_weight"]

DENSE_IMPLS = ("auto", "xla", "native", "native_int8")


def check_dense_impl(impl: str) -> str:
    """`impl` if it is one of DENSE_IMPLS, else ValueError."""
    return check_choice(impl, "dense_impl", DENSE_IMPLS)


def native_activations(x: jax.Array, w: Any, impl: str) -> str | None:
    """How `impl` runs x @ w: through the native kernel with 'float32' or 'int8' activations, or None (XLA).
    'auto': native on CPU for at most `native.dense.MAX_ROWS` rows of a bfloat16 or packed weight when the kernel
    can be built, with int8 activations for FP4 weights (`native_int8`) where they pay off
    (`native.build.int8_pays_off`)."""
    if impl == "auto":
        if not worth_it(x, w):
            return None
        impl = "native_int8" if int8_by_default(w) else "native"
    return {"native": "float32", "native_int8": "int8"}.get(impl)


def linear(x: jax.Array, w: Any, b: jax.Array | None = None, impl: str = "auto") -> jax.Array:
    """x [..., in] @ w.T (+ b [out]) -> [..., out] in x's dtype: w [out, in] as on disk, a float array or a
    quantized container.

    impl: 'xla' (a matmul; packed weights dequantized inside it, see `tutel_jax.quant._weights`), 'native' (the
    C++ CPU kernel `native.dense`: each weight byte read once, packed formats decoded in registers, float32
    accumulation), 'native_int8' ('native' with an FP4 weight's activations quantized to int8 per block of 32:
    integer dot products) or 'auto' (`native_activations`)."""
    activations = native_activations(x, w, impl)
    if activations is not None:
        return dense(x, w, b, activations=activations).astype(x.dtype)
    w = xla_weight(w)
    y = quant.dense(x, w) if quant.is_quantized(w) else matmul_out_in(x, w)
    return y if b is None else y + b


def head_linear(x: jax.Array, w: jax.Array, impl: str = "auto") -> jax.Array:
    """Each head its own projection: x [..., H, in] @ w[h].T -> [..., H, out] in x's dtype; w [H, out, in] float
    (e.g. MLA's absorbed kv_b_proj halves). impl as in `linear`: the native kernel, all heads in one call (a
    decode step's few rows of a bfloat16 stack on CPU), or one XLA einsum."""
    lead, (heads, k) = x.shape[:-2], x.shape[-2:]
    xh = jnp.swapaxes(x.reshape(-1, heads, k), 0, 1)  # [H, R, in]
    activations = native_activations(xh, w, impl)
    if activations is not None:
        y = dense(xh, w, activations=activations)  # [H, R, out]
        return jnp.swapaxes(y, 0, 1).reshape(*lead, heads, w.shape[1]).astype(x.dtype)
    return jnp.einsum("...hi,hoi->...ho", x, w.astype(x.dtype))


def xla_weight(w: Any) -> Any:
    """The weight as XLA's matmuls take it: a compact bfloat16 weight (`native.CompactBf16`, the native kernel's
    12-bit layout) as the bfloat16 array it holds, exactly (decoded natively on CPU); float arrays and quantized
    containers as they are."""
    return w.bfloat16() if isinstance(w, CompactBf16) else w


def matmul_out_in(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] @ w [out, in].T -> [..., out] through XLA, in the promoted dtype. Half-precision products are
    summed in float32 and rounded once: what XLA computes for them anyway (on CPU it would otherwise convert both
    operands, the whole weight included, to float32 in memory first, for every call; with float32 sums asked
    for, a bfloat16 matmul runs as one)."""
    dtype = jnp.result_type(x, w)
    if not (jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32):  # float32 and wider, integers
        return jnp.einsum("...k,nk->...n", x, w)
    return jnp.einsum("...k,nk->...n", x, w, preferred_element_type=jnp.float32).astype(dtype)
