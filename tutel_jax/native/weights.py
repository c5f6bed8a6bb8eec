"""Weights as the native CPU kernels take them: a format number and three arrays (see `weights.h`).

    weight_args(w) -> (format, data, scale, global_scale)

  float32 / bfloat16 kernel [E, K, N] ([in, out])       -> FLOAT32 / BFLOAT16, data as is
  float32 / bfloat16 rows [E, N, K] ([out, in], `rows`)  -> FLOAT32_ROWS / BFLOAT16_ROWS (an lm_head as stored)
  Fp8BlockWeight [E, N, K] (`pallas_kernels.quant`)      -> FP8_BLOCK, e4m3 codes, scale_inv float32
  Mxfp4Weight blocks [E, N, K/32, 16]                    -> MXFP4, codes uint8 [E, N, K/2], E8M0 scales
  Nvfp4Weight packed [E, N, K/2]                         -> NVFP4, codes, e4m3 scales, global [E]
                                                            (NVFP4_MUL: ModelOpt's multiplying global scale)

Every view is a reshape (no copy of the weight; e4m3 codes and scales go as they are, the kernels read their
bytes). `unsupported(w)` says why a weight cannot go to
the kernels (None when it can): float dtypes other than float32 and bfloat16.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ..quant import weights as quant_weights
from ..validation import check_int

__all__ = ["FLOAT32", "BFLOAT16", "FP8_BLOCK", "MXFP4", "NVFP4", "NVFP4_MUL", "FLOAT32_ROWS", "BFLOAT16_ROWS", "weight_args",
           "unsupported", "empty", "check_max_workers"]

FLOAT32, BFLOAT16, FP8_BLOCK, MXFP4, NVFP4, NVFP4_MUL, FLOAT32_ROWS, BFLOAT16_ROWS = range(8)
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_MAX_WORKERS = 1 << 30


def check_max_workers(max_workers: Any, what: str) -> int:
    """The kernels' max_workers attribute: a positive int, or None for XLA's whole intra-op pool."""
    check_int(max_workers, f"{what}: max_workers", minimum=1, optional=True)
    return int(max_workers or _MAX_WORKERS)


def empty() -> jax.Array:
    """The placeholder for an absent input (scale, global scale, bias)."""
    return jnp.zeros((0,), jnp.float32)


def unsupported(w: Any) -> str | None:
    """Why the kernels cannot read `w` (None: they can)."""
    if quant_weights.is_quantized(w):
        return None
    if jnp.dtype(w.dtype) not in FLOAT_DTYPES:
        return f"{jnp.dtype(w.dtype)} weights (float32, bfloat16 or packed only)"
    return None


def weight_args(w: Any, rows: bool = False) -> tuple[int, jax.Array, jax.Array, jax.Array]:
    """(format, data, scale, global) of a float kernel [E, K, N] (`rows`: float rows [E, N, K]) or a packed
    container [E, N, K]."""
    reason = unsupported(w)
    if reason is not None:
        raise ValueError(f"the native kernels cannot read {reason}")
    if not quant_weights.is_quantized(w):
        if rows:
            return (FLOAT32_ROWS if w.dtype == jnp.float32 else BFLOAT16_ROWS), w, empty(), empty()
        return (FLOAT32 if w.dtype == jnp.float32 else BFLOAT16), w, empty(), empty()
    if w.format == "fp8_block":
        return FP8_BLOCK, w.weight, w.scale_inv.astype(jnp.float32), empty()
    if w.format == "mxfp4":
        blocks = w.blocks
        return MXFP4, blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1]), w.scales, empty()
    num_experts = w.packed.shape[0]
    glob = jnp.broadcast_to(w.global_scale.astype(jnp.float32).reshape(-1), (num_experts,))
    return (NVFP4_MUL if w.global_multiplies else NVFP4), w.packed, w.scale, glob
