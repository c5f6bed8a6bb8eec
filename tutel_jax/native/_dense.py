"""A dense linear layer for a few rows in one native CPU call (`dense_cpu.cc`, an XLA FFI custom call).

    dense(x [..., K], w [N, K], b=None) -> float32 [..., N]
    dense(x [H, R, K], w [H, N, K])      -> float32 [H, R, N]   (each head h: x[h] @ w[h].T)

`w` is [N, K] ([out, in], as checkpoints store linear weights): float32 / bfloat16 rows (the models' linear
weights, lm_head and tied embedding), the same bfloat16 values in 12 bits (`CompactBf16`) or a packed container
(`pallas_kernels.quant`: FP8 block, MXFP4, NVFP4, per channel) of that logical shape. A decode step's attention
projections and lm_head are bound by reading their weights; XLA:CPU first converts a bfloat16 (or dequantizes a
packed) weight into float32 in memory, the kernel reads each weight byte once and decodes in registers.
`worth_it(x, w)` is the models' rule for using it (CPU, a few rows, a weight the kernel reads).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import core, quant
from ..core import varying_like
from ._build import can_register, isa, register
from ._weights import bias_arg, check_activations, check_max_workers, empty, unsupported, weight_args

__all__ = ["dense", "available", "worth_it", "compact_pays_off", "MAX_ROWS"]

TARGET = "tutel_jax_dense"
_LIBRARY = ("dense_cpu", "TutelJaxDense", TARGET)  # the source, its handler symbol, the FFI target
#: at most this many rows go to the kernel (decode and small batches); more rows are a matmul XLA does well
MAX_ROWS = 16


def ensure_registered() -> None:
    register(*_LIBRARY)


def available() -> bool:
    """True when the kernel is (or can be) built and registered here (CPU backend and a C++ compiler). A
    TUTEL_JAX_NATIVE_ISA that this CPU cannot run raises NativeKernelError instead."""
    return core.platform() == "cpu" and can_register(*_LIBRARY)


def compact_pays_off() -> bool:
    """Whether 'auto' loads bfloat16 models compact (`CompactBf16`) here: the kernel is available and its build
    decodes the codes faster than memory delivers them (x86 AVX2 / AVX-512: byte table lookups and unpacks,
    `packed_rows.h`; the NEON and portable builds decode element by element)."""
    return available() and isa() in ("avx2", "avx512")


def worth_it(x: jax.Array, w: Any) -> bool:
    """The kernel's case: CPU, at most MAX_ROWS rows, a 2-d bfloat16 weight or a packed weight it reads; or per
    head, x [H, R, K] and a stack [H, N, K] of them, at most MAX_ROWS rows R."""
    shape = quant.logical_shape(w)
    heads = len(shape) - 2
    if heads not in (0, 1) or (heads and (x.ndim != 3 or x.shape[0] != shape[0])):
        return False
    if math.prod(x.shape[heads:-1]) > MAX_ROWS or unsupported(w) is not None:
        return False
    if not quant.is_quantized(w) and w.dtype != jnp.bfloat16:  # compact: bfloat16 too
        return False  # float32 matvecs XLA streams well
    return available()


def dense(x: jax.Array, w: Any, b: jax.Array | None = None, *, activations: str = "float32",
          max_workers: int | None = None) -> jax.Array:
    """x [..., K] @ w.T (+ b [N]) -> float32 [..., N]; w [N, K] float rows or a packed container. Or per head:
    x [H, R, K] and a stack w [H, N, K] -> [H, R, N], row block h times w[h] (b [N] added to every head).
    activations: 'float32', or 'int8' for an MXFP4 / NVFP4 weight (see `moe.moe_experts`)."""
    workers = check_max_workers(max_workers, "dense")
    int8 = check_activations(activations, "dense")
    shape = quant.logical_shape(w)
    if len(shape) not in (2, 3):
        raise ValueError(f"dense: expected a 2-d weight or a 3-d stack of heads, got {shape}")
    n, k = shape[-2:]
    if x.shape[-1] != k:
        raise ValueError(f"dense: x [..., {x.shape[-1]}] does not match the weight's K={k}")
    if len(shape) == 3 and (x.ndim != 3 or x.shape[0] != shape[0]):
        raise ValueError(f"dense: a stack of {shape[0]} heads takes x [{shape[0]}, R, {k}], got {list(x.shape)}")
    if b is not None and tuple(b.shape) != (n,):
        raise ValueError(f"dense: bias must be [{n}], got {tuple(b.shape)}")
    fmt, data, scale, glob = weight_args(w if len(shape) == 3 else jax.tree_util.tree_map(lambda a: a[None], w))
    ensure_registered()
    rows = (x if len(shape) == 3 else x.reshape(-1, k)).astype(jnp.float32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(rows.shape[:-1] + (n,), jnp.float32),
                            vmap_method="sequential")
    y = call(rows, data, scale, glob, empty() if b is None else bias_arg(b), format=np.int64(fmt),
             int8_activations=int8, max_workers=np.int64(workers))
    y = varying_like(y, x, *jax.tree_util.tree_leaves((w, b)))
    return y.reshape(*x.shape[:-1], n)
