"""Random weights in every format the native kernels read, with their exact float64 values."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import pallas_kernels
from pallas_kernels.quant import Nvfp4Weight


def random_weight(rng: np.random.Generator, shape: tuple[int, ...], fmt: str):
    """(weight, float64 [..., out, in] value) of a N(0, 1/in) weight of logical shape [..., out, in] in `fmt`:
    'float32' / 'bfloat16' arrays, 'fp8_block', 'mxfp4', 'nvfp4' or 'nvfp4_mul' (ModelOpt's NVFP4, whose global
    scale multiplies) containers: every one [..., out, in], as the models keep their weights."""
    w = jnp.asarray(rng.normal(size=shape).astype(np.float32) * shape[-1] ** -0.5)
    if fmt in ("float32", "bfloat16"):
        w = w.astype(fmt)
        return w, np.asarray(w, np.float64)
    if fmt == "nvfp4_mul":
        q = pallas_kernels.quantize_nvfp4(w)
        q = Nvfp4Weight(q.packed, q.scale, 1.0 / q.global_scale, global_multiplies=True)
    else:
        q = getattr(pallas_kernels, f"quantize_{fmt}")(w)
    return q, np.asarray(q.dequantize(), np.float64)
