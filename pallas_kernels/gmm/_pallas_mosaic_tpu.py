"""Grouped matmul on TPUs: `gmm` and `tgmm` (_reference.py's semantics) on JAX's Mosaic megablox kernels.

    gmm_tpu(lhs[T, K], rhs[G, K, N] (or [G, N, K] transposed), group_sizes[G]) -> [T, N]
    tgmm_tpu(lhs[T, K], grad[T, N], group_sizes[G]) -> [G, K, N]

Rows of lhs are sorted by group; rows past sum(group_sizes) give zeros (gmm) and are ignored (tgmm); a group
that extends past T is cut at T; an empty group gives a zero [K, N] block (tgmm). The kernels are
`jax.experimental.pallas.ops.tpu.megablox.gmm.{gmm, tgmm}` (float32 accumulation in VMEM, a scalar-prefetched
(group, row tile) schedule); this module adapts shapes and semantics around them:

- rows: megablox needs T to be a multiple of the row tile tm, so lhs (and grad) get zero rows appended up to
  the next multiple; group sizes are clamped to T first, so the padding always lies past the last group.
- rows past the last group: megablox's gmm never writes the row tiles no group owns, so the output is masked
  to zero there (one select, fused with the slice back to T).
- K and N: a dim D uses the tile `min(D, 512)`. A full-dim block is always legal for Mosaic, whatever D is (its
  (8, 128) rule: the last two block dims are multiples of (8, 128) or equal the array's dims); a 512 tile is a
  multiple of 128. A partial last tile of the contraction dim is masked by megablox; a partial last tile of an
  output dim is clipped by the block writeback.
- tm: 128, or the row count rounded up to 16 when fewer (bf16 packs 16 rows per sublane tile).
- dtypes: float32 and bfloat16 inputs and outputs (megablox's own limit); bf16 x bf16 multiplies in bf16 on the
  MXU, any float32 operand promotes the dot to float32.
- T == 0, K == 0 or G == 0: no kernel, zeros of the right shape.

Both wrappers run inside `shard_map` with `check_vma` on: megablox builds its output types without manual-axis
types, so the call is traced with the check off and its outputs are then typed as varying over every mesh axis
an operand varies over (what the Triton kernels do, see `_util._varying_over_operands`).

Mosaic kernels cannot be partitioned by XLA's SPMD partitioner: on a multi-device TPU mesh the kernels must run
inside `shard_map` (all mesh axes of size > 1 manual). `check_supported` says so (NotSupported), which makes
"auto" use the XLA reference for such a call instead of failing at compile time.
"""

from __future__ import annotations

import importlib
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from .._manual import require_manual_axes, run_manual
from .._select import NotSupported
from ._reference import clamp_group_sizes

__all__ = ["TPU_DTYPES", "MAX_TILE", "GMM_SCOPE", "TGMM_SCOPE", "default_tpu_tiling", "check_supported", "gmm_tpu",
           "tgmm_tpu"]

#: input and output dtypes the megablox kernels accept
TPU_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
#: named scopes around the megablox calls: the Mosaic custom calls' op names say they are the project's kernels
GMM_SCOPE, TGMM_SCOPE = "tutel_tpu_gmm", "tutel_tpu_tgmm"
#: largest K / N tile (a multiple of 128); smaller dims take the whole dim as one tile
MAX_TILE = 512
#: row tile (megablox's default); fewer rows take the row count rounded up to ROW_ALIGN
ROW_TILE = 128
ROW_ALIGN = 16


def _megablox() -> Any:
    # the package's `gmm` attribute is the custom-VJP op (it shadows the module): import the module by path
    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def default_tpu_tiling(num_rows: int, k_dim: int, n_dim: int) -> tuple[int, int, int]:
    """(tm, tk, tn) for megablox: tm = min(128, rows rounded up to 16); tk, tn = the dim itself up to 512, else
    512 (see the module docstring for why each is legal)."""
    tm = min(ROW_TILE, _round_up(max(int(num_rows), 1), ROW_ALIGN))
    return tm, min(max(int(k_dim), 1), MAX_TILE), min(max(int(n_dim), 1), MAX_TILE)


def _check_tiling(tiling: Sequence[int], k_dim: int, n_dim: int) -> tuple[int, int, int]:
    if len(tiling) != 3 or not all(isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in tiling):
        raise ValueError(f"tiling must be three positive ints (tm, tk, tn), got {tiling!r}")
    tm, tk, tn = tiling
    if tm % 8:
        raise ValueError(f"tiling tm must be a multiple of 8 (Mosaic's sublane tile), got {tm}")
    for name, t, dim in (("tk", tk, k_dim), ("tn", tn, n_dim)):
        if t != dim and t % 128:
            raise ValueError(f"tiling {name} must be a multiple of 128 or equal the dim ({dim}), got {t}")
    return tm, tk, tn


def check_supported(*dtypes: Any, interpret: bool = False) -> None:
    """Raises NotSupported unless the TPU kernels can run a call with these operand / output dtypes.

    Args:
      dtypes: every input and output dtype of the call (and of its backward pass).
      interpret: the interpreter (CPU) runs anywhere; the compiled kernel needs every mesh axis of size > 1 in
        context to be manual (inside `shard_map`).
    """
    for dtype in dtypes:
        if jnp.dtype(dtype) not in TPU_DTYPES:
            raise NotSupported(f"the TPU grouped matmul takes float32 or bfloat16, got {jnp.dtype(dtype)}")
    if not interpret:
        require_manual_axes()


def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
    return x if x.shape[0] == rows else jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))


def gmm_tpu(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool = False,
            out_dtype: Any = None, interpret: bool = False, tiling: Sequence[int] | None = None) -> jax.Array:
    """Grouped matmul on the Mosaic megablox kernel (forward only; _api.py adds the VJP).

    Args:
      lhs: [T, K] float32 / bfloat16, rows sorted by group.
      rhs: [G, K, N], or [G, N, K] with transpose_rhs.
      group_sizes: [G] int rows per group.
      transpose_rhs: rhs is stored [G, N, K].
      out_dtype: float32 or bfloat16 (default: the promoted input dtype).
      interpret: run through Pallas' interpreter (CPU).
      tiling: (tm, tk, tn), default `default_tpu_tiling`.

    Returns:
      [T, N] in out_dtype: rows of group g are lhs[rows_g] @ rhs[g]; rows past sum(group_sizes) are zeros.
    """
    num_rows, k_dim = lhs.shape
    num_groups = rhs.shape[0]
    n_dim = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs.dtype, rhs.dtype))
    if num_rows == 0 or k_dim == 0 or num_groups == 0 or n_dim == 0:
        return jnp.zeros((num_rows, n_dim), out_dtype)
    tm, tk, tn = _check_tiling(tuple(tiling) if tiling else default_tpu_tiling(num_rows, k_dim, n_dim),
                               k_dim, n_dim)
    sizes, total = clamp_group_sizes(group_sizes, num_rows)
    padded = _round_up(num_rows, tm)

    def call(lhs, rhs, sizes):
        return _megablox().gmm(_pad_rows(lhs, padded), rhs, sizes, preferred_element_type=out_dtype,
                               tiling=(tm, tk, tn), transpose_rhs=bool(transpose_rhs), interpret=interpret)

    with jax.named_scope(GMM_SCOPE):
        out = run_manual(call, lhs, rhs, sizes)[:num_rows]
    # megablox leaves the row tiles no group owns unwritten
    owned = jnp.arange(num_rows, dtype=jnp.int32)[:, None] < total
    return jnp.where(owned, out, jnp.zeros((), out_dtype))


def tgmm_tpu(lhs: jax.Array, grad: jax.Array, group_sizes: jax.Array, *, num_groups: int | None = None,
             out_dtype: Any = None, interpret: bool = False, tiling: Sequence[int] | None = None) -> jax.Array:
    """Per-group `lhs[rows_g].T @ grad[rows_g]` on the Mosaic megablox kernel.

    Args:
      lhs: [T, K]; grad: [T, N] (float32 / bfloat16), rows sorted by group.
      group_sizes: [G] int rows per group.
      num_groups: G (default group_sizes' length).
      out_dtype: float32 or bfloat16 (default: the promoted input dtype).
      interpret: run through Pallas' interpreter (CPU).
      tiling: (tm, tk, tn): tm rows per reduction step, a [tk, tn] output tile (default `default_tpu_tiling`).

    Returns:
      [G, K, N] in out_dtype; an empty group gives zeros, rows past sum(group_sizes) are ignored.
    """
    num_rows, k_dim = lhs.shape
    n_dim = grad.shape[1]
    num_groups = group_sizes.shape[0] if num_groups is None else int(num_groups)
    out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs.dtype, grad.dtype))
    if num_rows == 0 or k_dim == 0 or n_dim == 0 or num_groups == 0:
        return jnp.zeros((num_groups, k_dim, n_dim), out_dtype)
    tm, tk, tn = _check_tiling(tuple(tiling) if tiling else default_tpu_tiling(num_rows, k_dim, n_dim),
                               k_dim, n_dim)
    sizes, _ = clamp_group_sizes(group_sizes, num_rows)
    padded = _round_up(num_rows, tm)

    def call(lhs, grad, sizes):
        # megablox takes lhs as [K, T] and transposes it back: XLA cancels the two transposes
        return _megablox().tgmm(_pad_rows(lhs, padded).T, _pad_rows(grad, padded), sizes,
                                preferred_element_type=out_dtype, tiling=(tm, tk, tn),
                                num_actual_groups=num_groups, interpret=interpret)

    with jax.named_scope(TGMM_SCOPE):
        return run_manual(call, lhs, grad, sizes)
