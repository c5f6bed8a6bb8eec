"""Quantized grouped matmul on TPUs: a Mosaic kernel reading packed expert weights and dequantizing in VMEM.

    quant_gmm_tpu(x[T, K], w (packed [G, N, K]), group_sizes[G]) -> [T, N]

Semantics are those of `reference.quant_gmm_reference`: rows of x are sorted by group, the rows of group g
are multiplied by dequant(w)[g].T, rows past sum(group_sizes) are zeros, a group extending past T is cut at T.
Formats (formats.py): FP8 block (`Fp8BlockWeight`), MXFP4 (`Mxfp4Weight`), NVFP4 (`Nvfp4Weight`), any N and K the
format allows (K % 32 == 0 for MXFP4, K % 16 == 0 for NVFP4, any K for FP8 block).

Schedule. XLA builds a static-length list of work items (group, row tile) like `gmm.pallas_triton.group_metadata`: every row
tile of tm rows that a group overlaps, in row order, then a pseudo group owning the rows past the last group
(it writes zeros); a tile shared by two groups appears once per group. W = cdiv(T, tm) + G items bound the list;
unused items at its end repeat the last row tile and do nothing. The list sits in SMEM by scalar prefetch
(`pltpu.PrefetchScalarGridSpec`), grid = (N tiles, W): N tiles outermost ("parallel": the two TensorCores of
a megacore chip take different N tiles), items inner. Per grid step the pipeline brings in, by DMA:
  - the item's row tile of x, whole rows [tm, K] (FP4 formats: the even and odd columns of x as two [tm, K/2]
    blocks, split once by XLA, because a packed byte holds the even element in its low nibble and the odd one
    in its high nibble, and interleaving the nibbles in VMEM is a costly lane shuffle on Mosaic);
  - the item's expert's packed weight tile [tn, K] (FP8, 1 byte per element) or [tn, K/2] (FP4 bytes), whole
    rows along K, and its scales (FP8: the 128 x 128 grid expanded by XLA to one float32 row per 128-column
    block, [ceil(K/128), N], about 3 % of the weight bytes; MXFP4 / NVFP4: the [tn, K/32] / [tn, K/16] rows
    as stored);
and consecutive items of one expert reuse the weight blocks already in VMEM (the pipeline skips the DMA of an
unchanged block; items without an expert keep the previous expert's block index for that reason).
Whole-K blocks keep every block legal for Mosaic's (8, 128) rule (a last dim equal to the array's, any K) and
make each step stream a large weight tile; the kernel loops over K in static chunks:
  - FP8 block: a [tn, 128] e4m3 chunk converts exactly to bfloat16 (or float32), one MXU dot per 128 columns,
    and the float32 partial product is multiplied per output column by that block's scale (the scale is constant
    over the chunk), so weights are never rounded after scaling.
  - MXFP4: per 512 columns, the packed bytes become two E2M1 nibble planes (integer shifts and masks, then
    float32 bit patterns, `quant.e2m1_to_f32`), times 2**(s - 127) repeated over each 32-column block
    (`quant.e8m0_to_f32`); each value has at most 2 significant bits: exact in bfloat16. Two dots (even
    columns with the low nibbles, odd with the high ones). The scales are repeated over their columns by a
    bfloat16 dot with a 0/1 matrix (the MXU broadcasts across lanes far more cheaply than Mosaic's lane
    shuffles): exact for every normal scale; s = 0 (2**-127, a subnormal) may flush to zero on the MXU, and
    s = 255 (NaN in the OCP MX spec, inf in the reference) is not a valid scale.
  - NVFP4: as MXFP4 with the e4m3 block scale per 16 columns (nibble x scale: at most 6 significant bits,
    exact in bfloat16); the per-expert global scale divides (or, `global_multiplies`, multiplies) the float32
    accumulator once, read from SMEM.
With bfloat16 activations the products are exact and only the float32 summation order (and, NVFP4, where the
global scale applies) differ from the reference; float32 activations take float32 dots at HIGHEST precision.

Row tiles are merged in the output block, which stays in VMEM while consecutive items visit the same row tile:
each item writes only the rows of its group (`where(row in group, acc, previous)`), and the first item of a row
tile starts from zeros instead of the block's uninitialised contents. N tails and T tails are partial blocks
(garbage rows of the weight only reach output columns past N, which the writeback clips).

Tiles (`default_tiling`): tm = the average rows per group rounded up to a power of two in [16, 128] (fewer rows
than that: all T rows), tn = 512, halved while the estimated VMEM footprint (`vmem_bytes`: double-buffered
blocks plus the chunk temporaries) exceeds VMEM_BUDGET; a call that does not fit even at tn = 128 and tm = 16
raises NotSupported ("auto" then runs the XLA reference). Inputs are float32 or bfloat16, outputs float32 or
bfloat16. Like every Mosaic kernel here it runs inside `shard_map` on a multi-device mesh
(`gmm.pallas_mosaic_tpu.check_supported`'s rule). Forward only: packed weights are inference weights, and the op adds no
VJP (as the Triton kernel of `quant_gmm`).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._manual import require_manual_axes, run_manual
from .._select import NotSupported
from .._util import cdiv
from ..gmm.pallas_mosaic_tpu import TPU_DTYPES
from .formats import (FP8_BLOCK, MXFP4_BLOCK, NVFP4_BLOCK, Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight, e2m1_to_f32,
                      e8m0_to_f32)

__all__ = ["quant_gmm_tpu", "check_supported", "default_tiling", "vmem_bytes", "work_items", "VMEM_BUDGET",
           "VMEM_LIMIT", "KERNEL_NAME"]

#: the pallas_call's name (the compiled HLO's op name contains it, with the format appended)
KERNEL_NAME = "tutel_tpu_quant_gmm"
#: largest estimated VMEM footprint of one grid step that `default_tiling` accepts
VMEM_BUDGET = 32 << 20
#: Mosaic's scoped-VMEM limit requested for the kernel (v5e / v5p / v6e cores have 95 MiB or more)
VMEM_LIMIT = 48 << 20
#: K columns dequantized per step of the in-kernel K loop (FP4 formats; FP8 goes by its 128-column blocks)
CHUNK_K = 512
MAX_ROW_TILE, MIN_ROW_TILE = 128, 16
TILE_N = (512, 256, 128)


def _format(w: Any) -> str:
    if isinstance(w, Fp8BlockWeight):
        return "fp8_block"
    if isinstance(w, Mxfp4Weight):
        return "mxfp4"
    if isinstance(w, Nvfp4Weight):
        return "nvfp4"
    raise NotSupported(f"the TPU quantized grouped matmul takes Fp8BlockWeight, Mxfp4Weight or Nvfp4Weight, got "
                       f"{type(w).__name__}")


def _pow2_at_least(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def vmem_bytes(fmt: str, tm: int, tn: int, k_dim: int, x_itemsize: int, out_itemsize: int) -> int:
    """Estimated VMEM of one grid step: double-buffered x / weight / scale / output blocks (lane dims padded to
    128, sublane dims to 32 for bytes) plus the float32 accumulator and the temporaries of one K chunk."""
    k_lanes = _round_up(k_dim, 128)
    tn_bytes = _round_up(tn, 32)
    if fmt == "fp8_block":
        weight = tn_bytes * k_lanes
        scale = _round_up(cdiv(k_dim, FP8_BLOCK), 8) * _round_up(tn, 128) * 4
        temps = 4 * tn * FP8_BLOCK * 4
    else:
        per_scale = MXFP4_BLOCK if fmt == "mxfp4" else NVFP4_BLOCK
        weight = tn_bytes * _round_up(k_dim // 2, 128)
        scale = tn_bytes * _round_up(k_dim // per_scale, 128)
        # the scale rows as float32, and a chunk's codes / values / repeated scales
        temps = tn * _round_up(k_dim // per_scale, 128) * 4 + 8 * tn * (CHUNK_K // 2) * 4
    x = tm * k_lanes * x_itemsize  # FP4: two halves of K / 2 columns
    out = tm * _round_up(tn, 128) * out_itemsize
    return 2 * (x + weight + scale + out) + temps + 2 * tm * _round_up(tn, 128) * 4


def default_tiling(fmt: str, num_rows: int, k_dim: int, n_dim: int, num_groups: int, x_dtype: Any,
                   out_dtype: Any) -> tuple[int, int]:
    """(tm, tn) for a call (see the module docstring); raises NotSupported when nothing fits VMEM_BUDGET."""
    x_size, out_size = jnp.dtype(x_dtype).itemsize, jnp.dtype(out_dtype).itemsize
    avg = cdiv(max(num_rows, 1), max(num_groups, 1))
    tm = min(MAX_ROW_TILE, max(MIN_ROW_TILE, _pow2_at_least(avg)))
    tm = num_rows if tm >= num_rows else tm  # a block of all rows is legal for any T
    tns = [n_dim] if n_dim <= TILE_N[-1] else [t for t in TILE_N if t <= _round_up(n_dim, 128)]
    while True:
        for tn in tns:
            if vmem_bytes(fmt, tm, tn, k_dim, x_size, out_size) <= VMEM_BUDGET:
                return tm, tn
        if tm <= MIN_ROW_TILE:
            raise NotSupported(f"{fmt} weights with K = {k_dim} do not fit the TPU kernel's VMEM budget "
                               f"({VMEM_BUDGET >> 20} MiB) even with [{tm}, {tns[-1]}] tiles")
        tm = max(MIN_ROW_TILE, tm // 2)


def _shape_of(w: Any) -> tuple[int, int, int]:
    shape = tuple(w.shape)
    if len(shape) != 3:
        raise ValueError(f"expected a packed weight [G, N, K], got shape {shape}")
    return shape


def check_supported(w: Any, x_dtype: Any, out_dtype: Any, num_rows: int, interpret: bool = False) -> None:
    """Raises NotSupported unless the TPU kernel can run this call.

    Args:
      w: the packed weight ([G, N, K] after dequantization).
      x_dtype, out_dtype: activation and output dtypes (float32 or bfloat16).
      num_rows: T (the tile choice depends on it).
      interpret: the interpreter (CPU) skips the rule that Mosaic kernels run inside shard_map.
    """
    fmt = _format(w)
    if fmt == "fp8_block" and jnp.dtype(w.weight.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise NotSupported(f"FP8 block weights must be float8_e4m3fn, got {w.weight.dtype}")
    if fmt == "nvfp4" and jnp.dtype(w.scale.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise NotSupported(f"NVFP4 block scales must be float8_e4m3fn, got {w.scale.dtype}")
    for what, dtype in (("activations", x_dtype), ("output", out_dtype)):
        if jnp.dtype(dtype) not in TPU_DTYPES:
            raise NotSupported(f"the TPU quantized grouped matmul takes float32 or bfloat16 {what}, got "
                               f"{jnp.dtype(dtype)}")
    num_groups, n_dim, k_dim = _shape_of(w)
    default_tiling(fmt, num_rows, k_dim, n_dim, num_groups, x_dtype, out_dtype)
    if not interpret:
        require_manual_axes()


# ------------------------------------------------------------------------------------------------ schedule


def work_items(group_sizes: jax.Array, num_rows: int, tm: int) -> tuple[jax.Array, ...]:
    """The kernel's work list (W = cdiv(T, tm) + G items, all int32 [W]).

    Returns:
      group: the item's group; G is the pseudo group of the rows past the last group (it writes zeros), G + 1
        an unused item.
      weight_group: the expert whose weight blocks the item's grid step maps (its own, else the last real
        item's, so that items without an expert cause no weight DMA).
      tile: the item's row tile (unused items: the last tile, which the last real item visits).
      start, end: the row range the item writes (empty for unused items).
      first: 1 when the item is the first to visit its row tile (the output block then starts from zeros).
    """
    num_groups = group_sizes.shape[0]
    num_tiles = cdiv(num_rows, tm)
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), num_rows)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    starts = jnp.concatenate([starts, ends[-1:]])  # + the pseudo group [sum, T)
    ends = jnp.concatenate([ends, jnp.full((1,), num_rows, jnp.int32)])
    first_tile = starts // tm
    tiles = jnp.where(ends > starts, (ends - 1) // tm - first_tile + 1, 0)
    bounds = jnp.cumsum(tiles)
    w = jnp.arange(num_tiles + num_groups, dtype=jnp.int32)
    group = jnp.searchsorted(bounds, w, side="right").astype(jnp.int32)  # in [0, G + 1]
    used = group <= num_groups
    g = jnp.minimum(group, num_groups)
    tile = jnp.where(used, first_tile[g] + w - (bounds[g] - tiles[g]), num_tiles - 1).astype(jnp.int32)
    start = jnp.where(used, starts[g], 0).astype(jnp.int32)
    end = jnp.where(used, ends[g], 0).astype(jnp.int32)
    first = (tile != jnp.concatenate([jnp.full((1,), -1, jnp.int32), tile[:-1]])).astype(jnp.int32)
    weight_group = jnp.maximum(lax.cummax(jnp.where(group < num_groups, group, -1)), 0).astype(jnp.int32)
    return group, weight_group, tile, start, end, first


# -------------------------------------------------------------------------------------------------- kernel


def _dot_nt(a: jax.Array, b: jax.Array, precision: Any) -> jax.Array:
    """a [m, c] . b [n, c] -> [m, n] float32 (b transposed on the MXU, no copy)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                           precision=precision)


def _repeat_lanes(s: jax.Array, times: int) -> jax.Array:
    """[r, c] -> [r, c * times] float32, each column repeated `times` times (one scale over its block of
    columns), as a dot with a 0/1 expansion matrix: the MXU does the lane broadcast, which Mosaic would
    otherwise build with costly lane shuffles. Exact for scales exact in bfloat16 (powers of two, e4m3)."""
    r, c = s.shape
    src = lax.broadcasted_iota(jnp.int32, (c, c * times), 0)
    dst = lax.broadcasted_iota(jnp.int32, (c, c * times), 1)
    expand = (dst // times == src).astype(jnp.bfloat16)
    return lax.dot_general(s.astype(jnp.bfloat16), expand, (((1,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32)


def _fp8_block_acc(refs, *, tm, tn, k_dim, compute_dtype, precision):
    """sum over 128-column blocks b of (x[:, b] . e4m3(w)[:, b].T) * scale[b, n]: [tm, tn] float32."""
    x_ref, w_ref, s_ref = refs
    acc = jnp.zeros((tm, tn), jnp.float32)
    for block, c0 in enumerate(range(0, k_dim, FP8_BLOCK)):
        c1 = min(c0 + FP8_BLOCK, k_dim)
        wc = w_ref[:, c0:c1].astype(compute_dtype)  # e4m3 -> bf16 / f32: exact
        part = _dot_nt(x_ref[:, c0:c1].astype(compute_dtype), wc, precision)
        acc = acc + part * s_ref[block:block + 1, :]
    return acc


def _fp4_acc(refs, *, tm, tn, k_dim, compute_dtype, precision, per_scale, scale_values):
    """sum over K chunks of x_even . (lo nibble values).T + x_odd . (hi nibble values).T: [tm, tn] float32.
    `scale_values(s_ref)` gives the float32 scale of every `per_scale` columns, [tn, K / per_scale]."""
    xe_ref, xo_ref, p_ref, s_ref = refs[:4]
    scales = scale_values(s_ref)
    half = k_dim // 2
    per_byte = per_scale // 2  # packed bytes under one scale
    acc = jnp.zeros((tm, tn), jnp.float32)
    for c0 in range(0, half, CHUNK_K // 2):
        c1 = min(c0 + CHUNK_K // 2, half)
        codes = p_ref[:, c0:c1].astype(jnp.int32)
        scale = _repeat_lanes(scales[:, c0 // per_byte:c1 // per_byte], per_byte)
        lo = (e2m1_to_f32(codes & 0xF) * scale).astype(compute_dtype)  # exact in bf16 (see the docstring)
        hi = (e2m1_to_f32(codes >> 4) * scale).astype(compute_dtype)
        acc = acc + _dot_nt(xe_ref[:, c0:c1].astype(compute_dtype), lo, precision)
        acc = acc + _dot_nt(xo_ref[:, c0:c1].astype(compute_dtype), hi, precision)
    return acc


def _mxfp4_scales(s_ref):
    return e8m0_to_f32(s_ref[...])


def _nvfp4_scales(s_ref):
    return s_ref[...].astype(jnp.float32)


def _kernel(group_ref, wgroup_ref, tile_ref, start_ref, end_ref, first_ref, *refs, fmt, num_groups, tm, tn,
            k_dim, compute_dtype, precision, global_divides):
    in_refs, out_ref = refs[:-1], refs[-1]
    item = pl.program_id(1)  # read at top level (the interpreter binds program ids only here)
    group = group_ref[item]
    rows = tile_ref[item] * tm + lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
    mine = (rows >= start_ref[item]) & (rows < end_ref[item])
    fresh = first_ref[item] == 1
    expert = wgroup_ref[item]

    def merge(value):
        # rows of other groups keep what earlier items wrote; a fresh tile holds garbage, which becomes zeros
        previous = jnp.where(fresh, jnp.zeros((tm, tn), out_ref.dtype), out_ref[...])
        out_ref[...] = jnp.where(mine, value.astype(out_ref.dtype), previous)

    @pl.when(group < num_groups)
    def _compute():
        kw = dict(tm=tm, tn=tn, k_dim=k_dim, compute_dtype=compute_dtype, precision=precision)
        if fmt == "fp8_block":
            acc = _fp8_block_acc(in_refs, **kw)
        elif fmt == "mxfp4":
            acc = _fp4_acc(in_refs, per_scale=MXFP4_BLOCK, scale_values=_mxfp4_scales, **kw)
        else:
            acc = _fp4_acc(in_refs, per_scale=NVFP4_BLOCK, scale_values=_nvfp4_scales, **kw)
            gs = in_refs[4][expert]
            acc = acc / gs if global_divides else acc * gs
        merge(acc)

    @pl.when(group >= num_groups)
    def _zeros():  # the pseudo group (rows past the groups) writes zeros; an unused item changes nothing
        merge(jnp.zeros((tm, tn), jnp.float32))


def _operands(fmt: str, x: jax.Array, w: Any, num_groups: int, n_dim: int, k_dim: int, tm: int, tn: int):
    """(activation operands, weight operands, their BlockSpecs) in the kernel's layouts (see the module
    docstring); index maps take (n tile, item, *work list)."""
    rows_spec = lambda cols: pl.BlockSpec((tm, cols), lambda n, i, g, wg, t, *_: (t[i], 0))
    if fmt == "fp8_block":
        kb = cdiv(k_dim, FP8_BLOCK)
        # [G, ceil(N/128), kb] -> [G, kb, N]: one float32 row of per-column scales per 128-column block of K
        scale = jnp.repeat(jnp.swapaxes(w.scale_inv.astype(jnp.float32), 1, 2), FP8_BLOCK, axis=2)[:, :, :n_dim]
        acts = (x,)
        weights = (w.weight, scale)
        specs = [rows_spec(k_dim),
                 pl.BlockSpec((None, tn, k_dim), lambda n, i, g, wg, *_: (wg[i], n, 0)),
                 pl.BlockSpec((None, kb, tn), lambda n, i, g, wg, *_: (wg[i], 0, n))]
        return acts, weights, specs
    if fmt == "mxfp4":
        packed = w.blocks.reshape(num_groups, n_dim, k_dim // 2)
        scales = w.scales
    else:
        packed, scales = w.packed, w.scale
    acts = (x[:, 0::2], x[:, 1::2])  # the low nibble of byte j is column 2j, the high one 2j + 1
    specs = [rows_spec(k_dim // 2), rows_spec(k_dim // 2),
             pl.BlockSpec((None, tn, k_dim // 2), lambda n, i, g, wg, *_: (wg[i], n, 0)),
             pl.BlockSpec((None, tn, scales.shape[-1]), lambda n, i, g, wg, *_: (wg[i], n, 0))]
    weights = (packed, scales)
    if fmt == "nvfp4":
        gs = jnp.broadcast_to(w.global_scale.astype(jnp.float32).reshape(-1), (num_groups,))
        weights = weights + (gs,)
        specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
    return acts, weights, specs


def quant_gmm_tpu(x: jax.Array, w: Any, group_sizes: jax.Array, *, out_dtype: Any = None,
                  interpret: bool = False, tiling: Sequence[int] | None = None) -> jax.Array:
    """Per-expert matmul with packed weights on the Mosaic kernel (forward only).

    Args:
      x: [T, K] float32 / bfloat16 activations, rows sorted by group.
      w: Fp8BlockWeight / Mxfp4Weight / Nvfp4Weight, [G, N, K] after dequantization ([experts, out, in]).
      group_sizes: [G] int rows per group (rows past their sum give zeros; groups past T are cut at T).
      out_dtype: float32 or bfloat16 (default x.dtype).
      interpret: run through Pallas' interpreter (CPU).
      tiling: (tm, tn), default `default_tiling`; tm a multiple of 16 or T, tn a multiple of 128 or N.

    Returns:
      [T, N] in out_dtype: rows of group g are x[rows_g] @ dequant(w)[g].T, accumulated in float32.
    """
    fmt = _format(w)
    num_groups, n_dim, k_dim = _shape_of(w)
    num_rows = x.shape[0]
    if x.ndim != 2 or x.shape[1] != k_dim or group_sizes.shape != (num_groups,):
        raise ValueError(f"need x [T, K={k_dim}] and group_sizes [{num_groups}]; got x {x.shape}, group_sizes "
                         f"{group_sizes.shape}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    check_supported(w, x.dtype, out_dtype, num_rows, interpret=True)  # formats and dtypes (mesh: the caller)
    if num_rows == 0 or n_dim == 0 or k_dim == 0 or num_groups == 0:
        return jnp.zeros((num_rows, n_dim), out_dtype)
    if tiling is None:
        tm, tn = default_tiling(fmt, num_rows, k_dim, n_dim, num_groups, x.dtype, out_dtype)
    else:
        tm, tn = (int(t) for t in tiling)
        if (tm != num_rows and tm % MIN_ROW_TILE) or (tn != n_dim and tn % 128) or tm <= 0 or tn <= 0:
            raise ValueError(f"tiling (tm, tn) needs tm a multiple of 16 (or T = {num_rows}) and tn a multiple "
                             f"of 128 (or N = {n_dim}), got {tiling!r}")
    compute_dtype = jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else lax.Precision.DEFAULT
    items = work_items(group_sizes, num_rows, tm)
    acts, weights, specs = _operands(fmt, x, w, num_groups, n_dim, k_dim, tm, tn)
    kernel = partial(_kernel, fmt=fmt, num_groups=num_groups, tm=tm, tn=tn, k_dim=k_dim,
                     compute_dtype=compute_dtype, precision=precision,
                     global_divides=not getattr(w, "global_multiplies", False))
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_rows, n_dim), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(items),
            grid=(cdiv(n_dim, tn), items[0].shape[0]),
            in_specs=specs,
            out_specs=pl.BlockSpec((tm, tn), lambda n, i, g, wg, t, *_: (t[i], n)),
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=VMEM_LIMIT),
        interpret=interpret,
        name=f"{KERNEL_NAME}_{fmt}",
    )
    return run_manual(lambda *operands: call(*operands), *items, *acts, *weights)
