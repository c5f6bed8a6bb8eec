"""Random weights in every format the native kernels read, with their exact float64 values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from pallas_kernels.quant import Nvfp4Weight
from tutel_jax import native


def random_weight(rng: np.random.Generator, shape: tuple[int, ...], fmt: str):
    """(weight, float64 [..., out, in] value) of a N(0, 1/in) weight of logical shape [..., out, in] in `fmt`:
    'float32' / 'bfloat16' arrays, 'fp8_block', 'mxfp4', 'nvfp4', 'nvfp4_mul' (ModelOpt's NVFP4, whose global
    scale multiplies), 'int8' or 'fp8_channel' containers, or 'compact_bf16' (`native.CompactBf16`, 2-d only, with
    a few elements of every kind that its codes do not hold: zeros, a subnormal, rare exponents): every one
    [..., out, in], as the models keep their weights."""
    w = jnp.asarray(rng.normal(size=shape).astype(np.float32) * shape[-1] ** -0.5)
    if fmt in ("float32", "bfloat16"):
        w = w.astype(fmt)
        return w, np.asarray(w, np.float64)
    if fmt == "compact_bf16":
        w = np.array(w.astype(jnp.bfloat16))
        for i, v in enumerate((0.0, -0.0, 1e-39, -3e-30, 1e4, -7.5)):  # coded zeros; patches
            w[(7 * i) % shape[0], (13 * i) % shape[1]] = v
        c = native.compact_bf16(w)
        assert c is not None and c.patches.shape[0] >= 4
        return c, np.asarray(w, np.float64)
    # quantized and dequantized in one program each (op by op, their many small ops compile one by one)
    if fmt == "nvfp4_mul":
        q = jax.jit(pallas_kernels.quantize_nvfp4)(w)
        q = Nvfp4Weight(q.packed, q.scale, 1.0 / q.global_scale, global_multiplies=True)
    else:
        q = jax.jit(getattr(pallas_kernels, f"quantize_{fmt}"))(w)
    return q, np.asarray(jax.jit(lambda weight: weight.dequantize())(q), np.float64)
