"""The quantized-matmul ops (forward only: quantized weights are frozen), one for every backend:

    quant_matmul(x[M, K], w[N, K] quantized) -> [M, N] = x @ dequant(w).T            (dense layers, decode)
    quant_gmm(x[T, K], w[G, N, K] quantized, group_sizes[G]) -> [T, N]               (MoE experts, rows by expert)

Weights keep the HF [out, in] layout (formats/). Semantics: _reference.py. `implementation` picks the backend
(`_select.choose`): "xla" (the reference), "pallas" / "interpret" (_pallas_triton.py: the grouped-matmul kernel
with a weight-tile loader per format), "tpu" / "tpu_interpret" (quant_gmm: the Mosaic kernel of
_pallas_mosaic_tpu.py, which dequantizes in VMEM).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .._select import TPU_IMPLEMENTATIONS, choose, resolved_name
from ..gmm import GmmConfig
from . import _pallas_mosaic_tpu as pallas_mosaic_tpu
from ._pallas_triton import check_triton, default_quant_config, quant_gmm_triton, with_group_dim
from ._reference import quant_gmm_reference, quant_matmul_reference

__all__ = ["quant_matmul", "quant_gmm"]


def quant_gmm(
    x: jax.Array,
    w: Any,
    group_sizes: jax.Array,
    *,
    out_dtype: Any = None,
    implementation: str | None = "auto",
    config: GmmConfig | None = None,
) -> jax.Array:
    """Per-expert quantized matmul (forward only; the weights are frozen).

    Args:
      x: [T, K] activations (bf16 or float32), rows sorted by expert.
      w: Fp8BlockWeight / Mxfp4Weight / Nvfp4Weight with a leading expert dim: [G, N, K] after dequantization.
      group_sizes: [G] int32 rows per expert (rows past the sum give zeros).
      out_dtype: default x.dtype.
      implementation: "auto", "xla", "pallas", "interpret", "tpu" or "tpu_interpret" (the Mosaic TPU kernel of
        _pallas_mosaic_tpu.py; "auto" on a TPU falls back to XLA where it declines the call).
      config: tiling of the Triton kernel (default `default_quant_config`; the TPU kernel has its own rule).

    Returns:
      [T, N].
    """
    if x.ndim != 2:
        raise ValueError(f"x must be [T, K], got {x.shape}")
    shape = w.shape
    if len(shape) != 3 or shape[-1] != x.shape[1] or group_sizes.shape != (shape[0],):
        raise ValueError(f"need w [G, N, K={x.shape[1]}] and group_sizes [G]; got w {shape}, "
                         f"group_sizes {group_sizes.shape}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    cfg = config or default_quant_config(x.shape[0], shape[2], shape[1], shape[0], x.dtype)
    interpret = resolved_name(implementation) == "tpu_interpret"  # the interpreter skips the shard_map rule
    impl = choose(implementation, lambda: check_triton(w, cfg),
                  tpu=lambda: pallas_mosaic_tpu.check_supported(w, x.dtype, out_dtype, x.shape[0],
                                                                interpret=interpret))
    if impl == "xla":
        return quant_gmm_reference(x, w, group_sizes, out_dtype=out_dtype)
    if impl in TPU_IMPLEMENTATIONS:
        return pallas_mosaic_tpu.quant_gmm_tpu(x, w, group_sizes.astype(jnp.int32), out_dtype=out_dtype,
                                               interpret=impl == "tpu_interpret")
    return quant_gmm_triton(x, w, group_sizes, out_dtype, cfg, impl == "interpret")


def quant_matmul(
    x: jax.Array,
    w: Any,
    *,
    out_dtype: Any = None,
    implementation: str | None = "auto",
    config: GmmConfig | None = None,
) -> jax.Array:
    """x @ dequant(w).T with the dequantization inside the kernel (forward only).

    Args:
      x: [M, K] activations (bf16 or float32).
      w: Fp8BlockWeight / Mxfp4Weight / Nvfp4Weight of logical shape [N, K] (HF [out, in]).
      out_dtype: default x.dtype.
      implementation: "auto", "xla", "pallas" or "interpret".
      config: tiling (default `default_quant_config`: split-K for M <= 64).

    Returns:
      [M, N].
    """
    if x.ndim != 2 or len(w.shape) != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"need x [M, K] and w [N, K] with the same K; got {x.shape} and {w.shape}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    cfg = config or default_quant_config(x.shape[0], w.shape[1], w.shape[0], 1, x.dtype)
    impl = choose(implementation, lambda: check_triton(with_group_dim(w), cfg))
    if impl == "xla":
        return quant_matmul_reference(x, w, out_dtype=out_dtype)
    sizes = jnp.full((1,), x.shape[0], jnp.int32)
    return quant_gmm(x, with_group_dim(w), sizes, out_dtype=out_dtype, implementation=impl, config=cfg)
