"""Weights as the native CPU kernels take them: a format number and three arrays (see `weights.h`).

    weight_args(w) -> (format, data, scale, global_scale)

  float32 / bfloat16 rows [E, N, K] ([out, in])         -> FLOAT32 / BFLOAT16, data as is
  a packed container [E, N, K] (`pallas_kernels.quant`)  -> its format's `native_args`: FP8_BLOCK (e4m3 codes,
                                                            float32 scale_inv), MXFP4 (codes uint8 [E, N, K/2],
                                                            E8M0 scales), NVFP4 / NVFP4_MUL (codes, e4m3 scales,
                                                            global [E]; MUL: ModelOpt's multiplying global),
                                                            INT8 / FP8_CHANNEL (int8 / e4m3 codes, float32
                                                            scales [E, N])
  a compact bfloat16 weight (`CompactBf16`)            -> COMPACT_BF16: groups, index, patches

Every view is a reshape (no copy of the weight; e4m3 codes and scales go as they are, the kernels read their
bytes). `unsupported(w)` says why a weight cannot go to
the kernels (None when it can): float dtypes other than float32 and bfloat16.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.quant import format_of
from pallas_kernels.quant.formats import FORMATS, absent, channel, fp8_block, mxfp4, nvfp4

from .. import quant
from ..validation import check_choice, check_int
from ._build import int8_pays_off
from ._compact_bf16 import NATIVE_ID as COMPACT_BF16, CompactBf16

__all__ = ["FLOAT32", "BFLOAT16", "COMPACT_BF16", "FP8_BLOCK", "MXFP4", "NVFP4", "NVFP4_MUL", "INT8", "FP8_CHANNEL",
           "ACTIVATIONS", "weight_args", "unsupported", "empty", "check_activations", "check_max_workers",
           "int8_capable", "int8_by_default", "bias_arg"]

FLOAT32, BFLOAT16 = 0, 1  # float [E, N, K] rows
# the packed formats' ids live in their format modules
FP8_BLOCK, MXFP4, NVFP4, NVFP4_MUL = fp8_block.NATIVE_ID, mxfp4.NATIVE_ID, nvfp4.NATIVE_ID, nvfp4.NATIVE_ID_MULTIPLIES
INT8, FP8_CHANNEL = channel.INT8_NATIVE_ID, channel.FP8_CHANNEL_NATIVE_ID
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_MAX_WORKERS = 1 << 30
#: how activations enter the FP4 (MXFP4, NVFP4) matmuls: 'float32' (exact products, float32
#: sums) or 'int8' (quantized per block of 32 to int8 with a float32 scale, integer dot products: q8_rows.h)
ACTIVATIONS = ("float32", "int8")


def int8_capable(w_or_format: Any) -> bool:
    """Whether `activations='int8'` changes how the kernels multiply this weight (a packed container, or a format
    name such as an experts' `weight_format`): FP4 formats (MXFP4, NVFP4); float, FP8 and int8 weights always take
    float32 activations."""
    fmt = FORMATS.get(w_or_format) if isinstance(w_or_format, str) else (
        format_of(w_or_format) if quant.is_quantized(w_or_format) else None)
    return fmt is not None and fmt.native_int8


def int8_by_default(w_or_format: Any) -> bool:
    """Whether 'auto' multiplies this weight (or format) by int8 activations here: an FP4 format
    (`int8_capable`) and a build whose byte dot products pay off (`build.int8_pays_off`)."""
    return int8_capable(w_or_format) and int8_pays_off()


def check_activations(activations: Any, what: str) -> bool:
    """The kernels' int8_activations attribute from `activations` (one of ACTIVATIONS), else ValueError."""
    check_choice(activations, f"{what}: activations", ACTIVATIONS)
    return activations == "int8"


def check_max_workers(max_workers: Any, what: str) -> int:
    """The kernels' max_workers attribute: a positive int, or None for XLA's whole intra-op pool."""
    check_int(max_workers, f"{what}: max_workers", minimum=1, optional=True)
    return int(max_workers or _MAX_WORKERS)


def bias_arg(b: jax.Array) -> jax.Array:
    """A bias as the kernels take it: float32 or bfloat16 as it is (no converted copy at every call), other
    dtypes as float32."""
    return b if jnp.dtype(b.dtype) in FLOAT_DTYPES else b.astype(jnp.float32)


def empty() -> jax.Array:
    """The placeholder for an absent input (scale, global scale, bias)."""
    return absent()


def unsupported(w: Any) -> str | None:
    """Why the kernels cannot read `w` (None: they can)."""
    if quant.is_quantized(w) or isinstance(w, CompactBf16):
        return None
    if jnp.dtype(w.dtype) not in FLOAT_DTYPES:
        return f"{jnp.dtype(w.dtype)} weights (float32, bfloat16 or packed only)"
    return None


def weight_args(w: Any) -> tuple[int, jax.Array, jax.Array, jax.Array]:
    """(format, data, scale, global) of a weight [E, N, K]: float rows or a packed container."""
    reason = unsupported(w)
    if reason is not None:
        raise ValueError(f"the native kernels cannot read {reason}")
    if isinstance(w, CompactBf16):
        return w.native_args()
    if not quant.is_quantized(w):
        return (FLOAT32 if w.dtype == jnp.float32 else BFLOAT16), w, empty(), empty()
    return format_of(w).native_args(w)
