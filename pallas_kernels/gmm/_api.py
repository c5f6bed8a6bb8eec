"""The grouped-matmul ops with their custom VJP, one for every backend:

    gmm(lhs[T, K], rhs[G, K, N] (or [G, N, K] with transpose_rhs), group_sizes[G]) -> [T, N]
    tgmm(lhs[T, K], grad[T, N], group_sizes[G]) -> [G, K, N]        (gmm's weight gradient, forward only)

Semantics: _reference.py. `implementation` picks the backend (`_select.choose`): "xla" (the reference),
"pallas" / "interpret" (_pallas_triton.py), "tpu" / "tpu_interpret" (JAX's Mosaic megablox kernels,
_pallas_mosaic_tpu.py; their own tiling rule, `config` / `tgmm_config` are the Triton tilings and do not apply),
"mosaic_gpu" (tokamax's Mosaic GPU ragged_dot on Hopper and Blackwell, _pallas_mosaic_gpu.py; by name only, see
`_select.py` for the H200 measurement that keeps "auto" on Triton).

The custom VJP is the same for every implementation: d lhs = gmm(g, rhs read transposed), d rhs = tgmm, each on
the forward's implementation, so a call that picked the TPU kernel runs its backward on it as well. A
"mosaic_gpu" forward takes d lhs from the Mosaic GPU kernel for 16-bit cotangents and d rhs from Triton:
tokamax's weight-gradient kernel gave wrong results on an H200 and is never used.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from .._manual import sum_to_primal_vma
from .._select import TPU_IMPLEMENTATIONS, choose, resolved_name
from . import _pallas_mosaic_gpu as pallas_mosaic_gpu, _pallas_mosaic_tpu as pallas_mosaic_tpu
from ._pallas_triton import GmmConfig, default_gmm_config, default_tgmm_config, gmm_triton, tgmm_triton
from ._reference import gmm_reference, tgmm_reference

__all__ = ["gmm", "tgmm"]


def _gmm_impl(impl, cfg, tcfg, transpose_rhs, out_dtype, lhs, rhs, group_sizes):
    if impl == "xla":
        return gmm_reference(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs,
                             preferred_element_type=out_dtype).astype(out_dtype)
    if impl in TPU_IMPLEMENTATIONS:
        return pallas_mosaic_tpu.gmm_tpu(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, out_dtype=out_dtype,
                               interpret=impl == "tpu_interpret")
    if impl == "mosaic_gpu":
        return pallas_mosaic_gpu.gmm_mosaic_gpu(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs,
                                             out_dtype=out_dtype)
    return gmm_triton(lhs, rhs, group_sizes, transpose_rhs, out_dtype, cfg, impl == "interpret")


def _tgmm_impl(impl, tcfg, out_dtype, lhs, grad, group_sizes, num_groups):
    if impl == "xla":
        return tgmm_reference(lhs, grad, group_sizes, preferred_element_type=out_dtype).astype(out_dtype)
    if impl in TPU_IMPLEMENTATIONS:
        return pallas_mosaic_tpu.tgmm_tpu(lhs, grad, group_sizes, num_groups=num_groups, out_dtype=out_dtype,
                                interpret=impl == "tpu_interpret")
    return tgmm_triton(lhs, grad, group_sizes, num_groups, out_dtype, tcfg, impl == "interpret")


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _gmm(impl, cfg, tcfg, transpose_rhs, out_dtype, lhs, rhs, group_sizes):
    return _gmm_impl(impl, cfg, tcfg, transpose_rhs, out_dtype, lhs, rhs, group_sizes)


def _gmm_fwd(impl, cfg, tcfg, transpose_rhs, out_dtype, lhs, rhs, group_sizes):
    out = _gmm_impl(impl, cfg, tcfg, transpose_rhs, out_dtype, lhs, rhs, group_sizes)
    return out, (lhs, rhs, group_sizes)


def _mosaic_or_triton(impl: str, *check_args: Any) -> str:
    """A backward gmm of a "mosaic_gpu" forward: Mosaic GPU where its kernel takes the call, else Triton."""
    if impl != "mosaic_gpu":
        return impl
    return "mosaic_gpu" if pallas_mosaic_gpu.supports(*check_args) else "pallas"


def _gmm_bwd(impl, cfg, tcfg, transpose_rhs, out_dtype, res, g):
    lhs, rhs, group_sizes = res
    num_groups = rhs.shape[0]
    k_dim, n_dim = (rhs.shape[2], rhs.shape[1]) if transpose_rhs else rhs.shape[1:]
    # d lhs = g @ rhs[g].T: the same kernel reading rhs the other way round (no transposed copy)
    dlhs_impl = _mosaic_or_triton(impl, g.dtype, rhs.dtype, lhs.dtype, n_dim, k_dim)
    drhs_impl = "pallas" if impl == "mosaic_gpu" else impl  # the weight gradient is always Triton's there
    dlhs = _gmm_impl(dlhs_impl, cfg, tcfg, not transpose_rhs, lhs.dtype, g, rhs, group_sizes)
    if transpose_rhs:  # rhs [G, N, K]: d rhs[g] = g[rows_g].T @ lhs[rows_g]
        drhs = _tgmm_impl(drhs_impl, tcfg, rhs.dtype, g, lhs, group_sizes, num_groups)
    else:
        drhs = _tgmm_impl(drhs_impl, tcfg, rhs.dtype, lhs, g, group_sizes, num_groups)
    # inside shard_map: replicated weights get the sum of the shards' gradients
    return sum_to_primal_vma(dlhs, lhs), sum_to_primal_vma(drhs, rhs), None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def _tpu_check(implementation, *dtypes):
    """The TPU kernel's NotSupported check for `choose` (the interpreter skips the mesh-partitioning rule)."""
    interpret = resolved_name(implementation) == "tpu_interpret"
    return lambda: pallas_mosaic_tpu.check_supported(*dtypes, interpret=interpret)


def _mosaic_gpu_check(*args):
    """The Mosaic GPU kernel's NotSupported check for `choose` (gmm only; see `_gmm_bwd` for the backward)."""
    return lambda: pallas_mosaic_gpu.check_supported(*args)


def _check_gmm(lhs, rhs, group_sizes, transpose_rhs):
    if lhs.ndim != 2 or rhs.ndim != 3:
        raise ValueError(f"gmm needs lhs [T, K] and rhs [G, K, N], got {lhs.shape} and {rhs.shape}")
    k_rhs = rhs.shape[2] if transpose_rhs else rhs.shape[1]
    if k_rhs != lhs.shape[1]:
        raise ValueError(f"contraction mismatch: lhs {lhs.shape}, rhs {rhs.shape} (transpose_rhs={transpose_rhs})")
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"group_sizes must be [G={rhs.shape[0]}], got {group_sizes.shape}")


def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = False,
    preferred_element_type: Any = None,
    implementation: str | None = "auto",
    config: GmmConfig | None = None,
    tgmm_config: GmmConfig | None = None,
) -> jax.Array:
    """Grouped matmul (differentiable in lhs and rhs).

    Args:
      lhs: [T, K], rows sorted by group.
      rhs: [G, K, N] (or [G, N, K] with transpose_rhs, e.g. HF [out, in] weights).
      group_sizes: [G] int32 rows per group; rows past their sum give zeros.
      transpose_rhs: rhs is stored [G, N, K].
      preferred_element_type: output dtype (default: the promoted input dtype); accumulation is float32.
      implementation: "auto", "xla", "pallas", "interpret", "tpu", "tpu_interpret" or "mosaic_gpu" (the TPU
        kernel takes float32 / bfloat16 operands and outputs; "auto" falls back to XLA for other dtypes; the
        Mosaic GPU kernel, tried first by "auto" on sm_90 / sm_100 with tokamax installed, takes bfloat16 /
        float16 operands with K and N multiples of 64, see `pallas_mosaic_gpu.check_supported`; "auto" falls back
        to Triton for other calls).
      config: forward tiling (default `default_gmm_config`); tgmm_config: the weight-gradient tiling (Triton;
        neither applies to the Mosaic GPU kernel, which takes tokamax's own).

    Returns:
      [T, N].
    """
    _check_gmm(lhs, rhs, group_sizes, transpose_rhs)
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype))
    # the backward runs on the same implementation: its cotangent has out_dtype
    k_dim, n_dim = (rhs.shape[2], rhs.shape[1]) if transpose_rhs else rhs.shape[1:]
    impl = choose(implementation, tpu=_tpu_check(implementation, lhs.dtype, rhs.dtype, out_dtype),
                  mosaic_gpu=_mosaic_gpu_check(lhs.dtype, rhs.dtype, out_dtype, k_dim, n_dim))
    cfg = config or default_gmm_config(lhs.shape[0], k_dim, n_dim, rhs.shape[0], lhs.dtype)
    tcfg = tgmm_config or default_tgmm_config(k_dim, n_dim, lhs.dtype)
    return _gmm(impl, cfg, tcfg, bool(transpose_rhs), out_dtype, lhs, rhs, group_sizes.astype(jnp.int32))


def tgmm(
    lhs: jax.Array,
    grad: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type: Any = None,
    implementation: str | None = "auto",
    config: GmmConfig | None = None,
) -> jax.Array:
    """Per-group `lhs[rows_g].T @ grad[rows_g]`: the weight gradient of gmm (forward only).

    Args:
      lhs: [T, K]; grad: [T, N]; rows sorted by group.
      group_sizes: [G] int32 (an empty group gives a zero [K, N] block).
      preferred_element_type: output dtype (default: the promoted input dtype).
      implementation, config: as for `gmm` (config.block_m rows per reduction step, block_k x block_n tile).

    Returns:
      [G, K, N].
    """
    if lhs.ndim != 2 or grad.ndim != 2 or lhs.shape[0] != grad.shape[0]:
        raise ValueError(f"tgmm needs lhs [T, K] and grad [T, N], got {lhs.shape} and {grad.shape}")
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, grad.dtype))
    impl = choose(implementation, tpu=_tpu_check(implementation, lhs.dtype, grad.dtype, out_dtype))
    cfg = config or default_tgmm_config(lhs.shape[1], grad.shape[1], lhs.dtype)
    return _tgmm_impl(impl, cfg, out_dtype, lhs, grad, group_sizes.astype(jnp.int32), group_sizes.shape[0])
