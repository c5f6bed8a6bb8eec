"""Grouped matmul on Pallas Triton kernels (NVIDIA sm_80 / sm_90 / sm_100, AMD gfx942), forward only (_api.py adds
the custom VJP):

    gmm_triton(lhs[T, K], rhs[G, K, N] (or [G, N, K] transposed), group_sizes[G], ...) -> [T, N]
    tgmm_triton(lhs[T, K], grad[T, N], group_sizes[G], ...) -> [G, K, N]

Semantics are _reference.py's. Kernel, megablox-style tile schedule:
  - XLA builds a schedule of work items (group g, row tile m): every row tile of size block_m that a group
    overlaps, in group order. A tile shared by two groups appears twice; each work item only STORES the rows of
    its own group, so two items never write the same element (no atomics, no races). The rows past the last
    group form a pseudo group that stores zeros. The number of work items is bounded statically by
    cdiv(T, block_m) + G; unused items exit at once.
  - grid = (N tiles, work items[, split_k]), N tiles fastest: the programs in flight share one lhs row tile
    (read once from DRAM for all N tiles) and the two row tiles of a group stream the same rhs[g] column slabs
    at about the same time (L2 hits), so each expert's weights are read about once.
  - each program loops over K in steps of block_k, accumulating `dot(lhs_tile, rhs_tile)` in float32.
Intended tiling on H100/H200 for the target T=16384, K=4096, N=1536, 64 balanced groups (256 rows each):
block_m=128 (each group = exactly 2 tiles, no partial tiles), block_n=128, block_k=64, 8 warps, 3 stages:
a 128x128 f32 accumulator, 2 x 16 KiB bf16 operand tiles per stage. Arithmetic intensity with each expert's
weights read once is about 210 FLOP/byte, near the H100 ridge, so keeping weight reads to one pass matters
more than the MMA tile shape.

The same kernel body serves the quantized per-expert matmul (`quant/_pallas_triton.py`) through a weight-tile
loader that dequantizes inside the kernel, and the decode case (few rows) through split-K.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from .._util import cdiv, check_pow2, col, row, triton_call
from ..targets import current_target

__all__ = ["GmmConfig", "gmm_triton", "tgmm_triton", "group_metadata", "default_gmm_config",
           "default_tgmm_config", "DenseRhs", "GMM_TILINGS", "TGMM_TILINGS", "tiling_candidates",
           "grouped_matmul_call"]


@dataclasses.dataclass(frozen=True)
class GmmConfig:
    """Tiling of the grouped-matmul kernels (all powers of two; dot dims >= 16).

    Attributes:
      block_m: rows per tile (gmm) / rows per reduction step (tgmm).
      block_n: output columns per program.
      block_k: contraction step (gmm) / output rows of the [K, N] gradient per program (tgmm).
      split_k: gmm only: the K loop is split over this many programs whose float32 partials are summed by
        XLA (for few rows, e.g. decode, where N tiles alone do not fill the GPU).
      num_warps, num_stages: Triton launch parameters (num_stages = software-pipelining depth of the K loop).
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    split_k: int = 1
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            check_pow2(name, getattr(self, name), 16)
        check_pow2("split_k", self.split_k)
        check_pow2("num_warps", self.num_warps)
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")


def _pow2_at_most(n: int, cap: int, floor: int = 16) -> int:
    n = max(int(n), 1)
    return max(floor, min(cap, 1 << (n - 1).bit_length()))


#: Largest tiles per target and operand width ("bf16": 16-bit, "f32": 32-bit operands). The defaults shrink them
#: to the problem (rows per group, N, K); shared memory per stage is (bm * bk + bk * bn) * itemsize, so MI300's
#: 64 KiB LDS holds two stages of the 16-bit tile where the NVIDIA targets pipeline three.
GMM_TILINGS: dict[str, dict[str, GmmConfig]] = {
    "sm_80": {"bf16": GmmConfig(128, 128, 64, 1, 8, 3), "f32": GmmConfig(64, 128, 32, 1, 4, 3)},
    "sm_90": {"bf16": GmmConfig(128, 128, 64, 1, 8, 3), "f32": GmmConfig(64, 128, 32, 1, 4, 3)},
    "sm_100": {"bf16": GmmConfig(128, 128, 64, 1, 8, 3), "f32": GmmConfig(64, 128, 32, 1, 4, 3)},  # as sm_90
    "gfx942": {"bf16": GmmConfig(128, 128, 64, 1, 8, 2), "f32": GmmConfig(64, 128, 32, 1, 4, 2)},
}
#: tgmm (weight gradient): a [block_k, block_n] output tile per program, block_m rows per reduction step
TGMM_TILINGS: dict[str, dict[str, GmmConfig]] = {
    "sm_80": {"bf16": GmmConfig(64, 128, 128, 1, 8, 3), "f32": GmmConfig(32, 128, 64, 1, 8, 3)},
    "sm_90": {"bf16": GmmConfig(64, 128, 128, 1, 8, 3), "f32": GmmConfig(32, 128, 64, 1, 8, 3)},
    "sm_100": {"bf16": GmmConfig(64, 128, 128, 1, 8, 3), "f32": GmmConfig(32, 128, 64, 1, 8, 3)},  # as sm_90
    "gfx942": {"bf16": GmmConfig(64, 128, 128, 1, 8, 2), "f32": GmmConfig(32, 128, 64, 1, 8, 2)},
}


def _width(dtype: Any) -> str:
    return "f32" if jnp.dtype(dtype).itemsize >= 4 else "bf16"


def _gmm_tiling(base: GmmConfig, bm: int, n: int, k: int) -> GmmConfig:
    return dataclasses.replace(base, block_m=bm, block_n=_pow2_at_most(n, base.block_n),
                               block_k=_pow2_at_most(k, base.block_k), num_warps=base.num_warps if bm >= 128 else 4)


def default_gmm_config(num_rows: int, k: int, n: int, num_groups: int, dtype: Any, target: str | None = None
                       ) -> GmmConfig:
    """The target's tile (`GMM_TILINGS`), with smaller row tiles when the average group has fewer rows than the
    tile (fewer rows wasted in partial tiles) and N / K tiles no larger than the problem."""
    base = GMM_TILINGS[target or current_target().name][_width(dtype)]
    avg = max(num_rows // max(num_groups, 1), 1)
    return _gmm_tiling(base, _pow2_at_most(avg, base.block_m), n, k)


def default_tgmm_config(k: int, n: int, dtype: Any, target: str | None = None) -> GmmConfig:
    """tgmm: the target's tile (`TGMM_TILINGS`), no larger than the [K, N] gradient."""
    base = TGMM_TILINGS[target or current_target().name][_width(dtype)]
    return dataclasses.replace(base, block_n=_pow2_at_most(n, base.block_n), block_k=_pow2_at_most(k, base.block_k))


def tiling_candidates(target: str, op: str = "gmm") -> dict[str, GmmConfig]:
    """Every tiling `default_gmm_config` ("gmm") or `default_tgmm_config` ("tgmm") can pick for `target` at full
    N and K (smaller N / K only shrink tiles), keyed by a label such as "bf16_bm64"."""
    tables = {"gmm": GMM_TILINGS, "tgmm": TGMM_TILINGS}[op][target]
    if op == "tgmm":
        return dict(tables)
    candidates = {}
    for width, base in tables.items():
        bm = 16
        while bm <= base.block_m:
            candidates[f"{width}_bm{bm}"] = _gmm_tiling(base, bm, base.block_n, base.block_k)
            bm *= 2
    return candidates


# ---------------------------------------------------------------------------------------- tile schedule


def group_metadata(group_sizes: jax.Array, num_rows: int, block_m: int):
    """The static-length work list of the gmm kernel.

    Args:
      group_sizes: [G] int, rows per group (rows sorted by group).
      num_rows: T.
      block_m: row tile size.

    Returns:
      work_group: [W] int32, group of each work item; G is the pseudo group of the rows past the last group
        (zero-filled), G + 1 marks an unused item. W = cdiv(T, block_m) + G.
      work_tile: [W] int32 row tile of each work item.
      starts, ends: [G + 2] int32 row range of each group (pseudo group G; G + 1 is empty).
    """
    num_groups = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), num_rows)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    total = ends[-1] if num_groups else jnp.int32(0)
    starts = jnp.concatenate([starts, jnp.stack([total, 0]).astype(jnp.int32)])
    ends = jnp.concatenate([ends, jnp.asarray([num_rows, 0], jnp.int32)])
    sizes = ends - starts
    first = starts // block_m
    tiles = jnp.where(sizes > 0, (ends - 1) // block_m - first + 1, 0)  # tiles each group overlaps
    bounds = jnp.cumsum(tiles)
    num_work = cdiv(num_rows, block_m) + num_groups
    w = jnp.arange(num_work, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(bounds, w, side="right"), num_groups + 1).astype(jnp.int32)
    tile = first[group] + w - (bounds[group] - tiles[group])
    tile = jnp.where(group <= num_groups, tile, 0).astype(jnp.int32)
    return group, tile, starts, ends


# -------------------------------------------------------------------------------------------- weight tiles


class DenseRhs:
    """Weight-tile loader for a plain rhs [G, K, N] (or [G, N, K] when transposed).

    A loader gives the kernel, for group g and the index vectors ks [bk] / ns [bn], the weight tile in the
    compute dtype, whether it is laid out [bn, bk] (`transposed`), an optional per-column scale applied to the
    step's partial product (FP8 block scales), and an optional per-group scale applied at the end (NVFP4's
    global scale). Quantized loaders live in quant/_pallas_triton.py.
    """

    num_refs = 1

    def __init__(self, transposed: bool):
        self.transposed = transposed

    def check_block_k(self, block_k: int) -> None:
        pass

    def tile(self, refs, g, k0, ks, ns, kmask, nmask, compute_dtype):
        (rhs_ref,) = refs
        if self.transposed:
            w = plt.load(rhs_ref.at[g, row(ns), col(ks)], mask=row(nmask) & col(kmask), other=0)
        else:
            w = plt.load(rhs_ref.at[g, row(ks), col(ns)], mask=row(kmask) & col(nmask), other=0)
        return w.astype(compute_dtype)

    def step_scale(self, refs, g, k0, ns, nmask):
        return None

    def final_scale(self, refs, g):
        return None


def _dot(a: jax.Array, b: jax.Array, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
    """float32-accumulating dot of 2-D tiles (the Triton lowering accumulates in the output dtype)."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------------------------- kernels


def _gmm_kernel(group_ref, tile_ref, start_ref, end_ref, lhs_ref, *refs, loader, num_groups, num_rows,
                k_dim, n_dim, bm, bn, bk, split_k, compute_dtype):
    rhs_refs, out_ref = refs[:-1], refs[-1]
    # program ids are read here, not inside the pl.when bodies: the interpreter only binds them at top level
    n_tile, w = pl.program_id(0), pl.program_id(1)
    split = pl.program_id(2) if split_k > 1 else 0
    g = group_ref[w]
    start, end = start_ref[g], end_ref[g]
    rows = tile_ref[w] * bm + jnp.arange(bm, dtype=jnp.int32)
    mine = (rows >= start) & (rows < end)  # rows this work item owns (the only rows it stores)
    in_range = rows < num_rows
    ns = n_tile * bn + jnp.arange(bn, dtype=jnp.int32)
    nmask = ns < n_dim
    steps = cdiv(k_dim, bk)
    out_idx = (split, row(rows), col(ns)) if split_k > 1 else (row(rows), col(ns))
    store_mask = row(mine) & col(nmask)

    @pl.when(g < num_groups)
    def _compute():
        if split_k > 1:  # this program's share of the K loop
            per = cdiv(steps, split_k)
            lo = split * per
            hi = jnp.minimum(lo + per, steps)
        else:
            lo, hi = 0, steps

        def body(step, acc):
            ks = step * bk + jnp.arange(bk, dtype=jnp.int32)
            kmask = ks < k_dim
            a = plt.load(lhs_ref.at[row(rows), col(ks)], mask=row(in_range) & col(kmask), other=0)
            wt = loader.tile(rhs_refs, g, step * bk, ks, ns, kmask, nmask, compute_dtype)
            part = _dot(a.astype(compute_dtype), wt, trans_b=loader.transposed)
            scale = loader.step_scale(rhs_refs, g, step * bk, ns, nmask)
            return acc + (part if scale is None else part * col(scale))

        acc = lax.fori_loop(lo, hi, body, jnp.zeros((bm, bn), jnp.float32))
        final = loader.final_scale(rhs_refs, g)
        if final is not None:  # a per-group divisor (or multiplier: loader.final_divides False)
            acc = acc / final if getattr(loader, "final_divides", True) else acc * final
        plt.store(out_ref.at[out_idx], acc.astype(out_ref.dtype), mask=store_mask)

    @pl.when(g == num_groups)
    def _zeros():  # rows past the last group: ragged_dot gives zeros
        plt.store(out_ref.at[out_idx], jnp.zeros((bm, bn), out_ref.dtype), mask=store_mask)


def _tgmm_kernel(start_ref, end_ref, lhs_ref, grad_ref, out_ref, *, k_dim, n_dim, bm, bk, bn, compute_dtype):
    n_tile, k_tile, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = start_ref[g], end_ref[g]
    ks = k_tile * bk + jnp.arange(bk, dtype=jnp.int32)
    ns = n_tile * bn + jnp.arange(bn, dtype=jnp.int32)
    kmask, nmask = ks < k_dim, ns < n_dim

    def body(step, acc):
        rows = start + step * bm + jnp.arange(bm, dtype=jnp.int32)
        rmask = rows < end  # rows outside the group must load as exact zeros: they are contracted
        a = plt.load(lhs_ref.at[row(rows), col(ks)], mask=row(rmask) & col(kmask), other=0)
        b = plt.load(grad_ref.at[row(rows), col(ns)], mask=row(rmask) & col(nmask), other=0)
        return acc + _dot(a.astype(compute_dtype), b.astype(compute_dtype), trans_a=True)

    acc = lax.fori_loop(0, cdiv(end - start, bm), body, jnp.zeros((bk, bn), jnp.float32))
    plt.store(out_ref.at[g, row(ks), col(ns)], acc.astype(out_ref.dtype), mask=row(kmask) & col(nmask))


def _compute_dtype(*dtypes) -> Any:
    """bf16/f16 tensor-core dots when the activations are 16-bit, float32 otherwise."""
    dt = jnp.result_type(*dtypes)
    return dt if dt in (jnp.bfloat16, jnp.float16) else jnp.float32


def grouped_matmul_call(lhs: jax.Array, rhs_operands: Sequence[jax.Array], loader: Any, group_sizes: jax.Array,
                        n_dim: int, out_dtype: Any, cfg: GmmConfig, interpret: bool,
                        compute_dtype: Any = None, name: str = "tutel_gmm") -> jax.Array:
    """Runs the grouped-matmul kernel with any weight-tile loader. lhs [T, K] -> [T, n_dim]."""
    num_rows, k_dim = lhs.shape
    num_groups = group_sizes.shape[0]
    loader.check_block_k(cfg.block_k)
    compute_dtype = compute_dtype or _compute_dtype(lhs.dtype)
    group, tile, starts, ends = group_metadata(group_sizes, num_rows, cfg.block_m)
    split_k = min(cfg.split_k, cdiv(k_dim, cfg.block_k))
    kernel = partial(_gmm_kernel, loader=loader, num_groups=num_groups, num_rows=num_rows, k_dim=k_dim,
                     n_dim=n_dim, bm=cfg.block_m, bn=cfg.block_n, bk=cfg.block_k, split_k=split_k,
                     compute_dtype=compute_dtype)
    grid = (cdiv(n_dim, cfg.block_n), group.shape[0]) + ((split_k,) if split_k > 1 else ())
    shape = (split_k, num_rows, n_dim) if split_k > 1 else (num_rows, n_dim)
    out = triton_call(kernel, out_shape=jax.ShapeDtypeStruct(shape, jnp.float32 if split_k > 1 else out_dtype),
                      grid=grid, num_warps=cfg.num_warps, num_stages=cfg.num_stages, interpret=interpret,
                      name=name)(group, tile, starts, ends, lhs, *rhs_operands)
    if split_k > 1:  # deterministic reduction of the float32 partials
        out = jnp.sum(out, axis=0).astype(out_dtype)
    return out


def gmm_triton(lhs, rhs, group_sizes, transpose_rhs, out_dtype, cfg, interpret):
    n_dim = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    return grouped_matmul_call(lhs, (rhs,), DenseRhs(transpose_rhs), group_sizes, n_dim, out_dtype, cfg,
                               interpret, compute_dtype=_compute_dtype(lhs.dtype, rhs.dtype))


def tgmm_triton(lhs, grad, group_sizes, num_groups, out_dtype, cfg, interpret):
    num_rows, k_dim = lhs.shape
    n_dim = grad.shape[1]
    _, _, starts, ends = group_metadata(group_sizes, num_rows, cfg.block_m)
    kernel = partial(_tgmm_kernel, k_dim=k_dim, n_dim=n_dim, bm=cfg.block_m, bk=cfg.block_k, bn=cfg.block_n,
                     compute_dtype=_compute_dtype(lhs.dtype, grad.dtype))
    return triton_call(kernel, out_shape=jax.ShapeDtypeStruct((num_groups, k_dim, n_dim), out_dtype),
                       grid=(cdiv(n_dim, cfg.block_n), cdiv(k_dim, cfg.block_k), num_groups),
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages, interpret=interpret,
                       name="tutel_tgmm")(starts, ends, lhs, grad)
