"""Quantized grouped matmul on TPUs: a Mosaic kernel reading packed expert weights and dequantizing in VMEM.

    quant_gmm_tpu(x[T, K], w (packed [G, N, K]), group_sizes[G]) -> [T, N]

Semantics are those of `reference.quant_gmm_reference`: rows of x are sorted by group, the rows of group g
are multiplied by dequant(w)[g].T, rows past sum(group_sizes) are zeros, a group extending past T is cut at T.
Formats (formats/, each with its operands, per-tile accumulation and VMEM estimate): FP8 block
(`Fp8BlockWeight`), MXFP4 (`Mxfp4Weight`), NVFP4 (`Nvfp4Weight`), any N and K the format allows (K % 32 == 0
for MXFP4, K % 16 == 0 for NVFP4, any K for FP8 block).

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
    float32 bit patterns, `e2m1_to_f32`), times 2**(s - 127) repeated over each 32-column block
    (`e8m0_to_f32`); each value has at most 2 significant bits: exact in bfloat16. Two dots (even
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
from ..gmm import TPU_DTYPES
from .formats import FORMATS, QuantFormat, format_of, round_up

__all__ = ["quant_gmm_tpu", "check_supported", "default_tiling", "vmem_bytes", "work_items", "VMEM_BUDGET",
           "VMEM_LIMIT", "KERNEL_NAME"]

#: the pallas_call's name (the compiled HLO's op name contains it, with the format appended)
KERNEL_NAME = "tutel_tpu_quant_gmm"
#: largest estimated VMEM footprint of one grid step that `default_tiling` accepts
VMEM_BUDGET = 32 << 20
#: Mosaic's scoped-VMEM limit requested for the kernel (v5e / v5p / v6e cores have 95 MiB or more)
VMEM_LIMIT = 48 << 20
MAX_ROW_TILE, MIN_ROW_TILE = 128, 16
TILE_N = (512, 256, 128)


def _format(w: Any) -> QuantFormat:
    fmt = format_of(w)
    if fmt is None:
        raise NotSupported(f"the TPU quantized grouped matmul takes "
                           f"{', '.join(f.container.__name__ for f in FORMATS.values())}, got {type(w).__name__}")
    return fmt


def _pow2_at_least(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def vmem_bytes(fmt: QuantFormat, tm: int, tn: int, k_dim: int, x_itemsize: int, out_itemsize: int) -> int:
    """Estimated VMEM of one grid step: double-buffered x / weight / scale / output blocks (lane dims padded to
    128, sublane dims to 32 for bytes; the format's `tpu.vmem`) plus the float32 accumulator and the format's
    temporaries."""
    weight, scale, temps = fmt.tpu.vmem(tm, tn, k_dim)
    x = tm * round_up(k_dim, 128) * x_itemsize  # FP4: two halves of K / 2 columns
    out = tm * round_up(tn, 128) * out_itemsize
    return 2 * (x + weight + scale + out) + temps + 2 * tm * round_up(tn, 128) * 4


def default_tiling(fmt: QuantFormat, num_rows: int, k_dim: int, n_dim: int, num_groups: int, x_dtype: Any,
                   out_dtype: Any) -> tuple[int, int]:
    """(tm, tn) for a call (see the module docstring); raises NotSupported when nothing fits VMEM_BUDGET."""
    x_size, out_size = jnp.dtype(x_dtype).itemsize, jnp.dtype(out_dtype).itemsize
    avg = cdiv(max(num_rows, 1), max(num_groups, 1))
    tm = min(MAX_ROW_TILE, max(MIN_ROW_TILE, _pow2_at_least(avg)))
    tm = num_rows if tm >= num_rows else tm  # a block of all rows is legal for any T
    tns = [n_dim] if n_dim <= TILE_N[-1] else [t for t in TILE_N if t <= round_up(n_dim, 128)]
    while True:
        for tn in tns:
            if vmem_bytes(fmt, tm, tn, k_dim, x_size, out_size) <= VMEM_BUDGET:
                return tm, tn
        if tm <= MIN_ROW_TILE:
            raise NotSupported(f"{fmt.name} weights with K = {k_dim} do not fit the TPU kernel's VMEM budget "
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
    fmt.tpu.check(w)
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


def _kernel(group_ref, wgroup_ref, tile_ref, start_ref, end_ref, first_ref, *refs, accumulate, num_groups, tm, tn,
            k_dim, compute_dtype, precision):
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
        merge(accumulate(in_refs, expert, tm=tm, tn=tn, k_dim=k_dim, compute_dtype=compute_dtype,
                         precision=precision))

    @pl.when(group >= num_groups)
    def _zeros():  # the pseudo group (rows past the groups) writes zeros; an unused item changes nothing
        merge(jnp.zeros((tm, tn), jnp.float32))


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
    acts, weights, specs = fmt.tpu.operands(x, w, num_groups, n_dim, k_dim, tm, tn)
    kernel = partial(_kernel, accumulate=fmt.tpu.accumulator(w), num_groups=num_groups, tm=tm, tn=tn, k_dim=k_dim,
                     compute_dtype=compute_dtype, precision=precision)
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
        name=f"{KERNEL_NAME}_{fmt.name}",
    )
    return run_manual(lambda *operands: call(*operands), *items, *acts, *weights)
