"""Dispatch (encode) and combine (decode) on TPUs: Mosaic kernels gathering rows by DMA.

Semantics are those of _reference.py:
  encode_tpu(x[S, M], weights[k, S], slots[k, S], num_slots) -> [num_slots, M]
      out[slot] = weights[j, s] * x[s] for the assignment (j, s) owning the slot, zeros for an empty slot.
  decode_tpu(data[num_slots, M], weights[k, S], slots[k, S]) -> [S, M]
      y[s] = sum_j weights[j, s] * data[slots[j, s]], dropped assignments (slot outside [0, num_slots)) add 0.
permute / unpermute (the dropless layout) are the same two ops.

Kernel (`_gather_kernel`, shared by both): the output is cut into blocks of R full rows; grid step i builds
block i. The source stays in HBM (`pl.ANY`); a row -> source-row table sits in SMEM by scalar prefetch
(`pltpu.PrefetchScalarGridSpec`), -1 marking "no source" (an empty slot, a dropped assignment). For each of
its k * R output terms the step starts one row DMA (HBM -> VMEM, [1, M]) unless the term has no source, waits
for all of them on one DMA semaphore, and then computes in float32
    out[r] = sum_j where(keep[j, r], buf[j, r] * w[j, r], 0)
(k = 1 for encode). `keep` and `w` are [k, rows, 1] float32 VMEM blocks ((R, 1) trailing block dims: R is a
multiple of 8 and 1 is the full dim, Mosaic's (8, 128) rule), so a missing term is an exact zero whatever the
unwritten buffer row holds. Rows are whole (block width = M, legal for any M), so no column tiling is needed.
The output block (R, M) is written back by the pipeline; a partial last block is clipped.

Numerics: encode multiplies the weight rounded to x's dtype by the row in float32 and rounds once, which equals
the reference's multiply in x's dtype (the product of two bf16 values is exact in float32). decode rounds the
weights to data's dtype like the reference and accumulates the k terms in float32 in choice order (the reference
sums in data's dtype: equal in float32 up to rounding of the sum, within bf16 rounding otherwise).

Row DMAs land at any row offset only in a 32-bit buffer: Mosaic packs 16-bit rows two per sublane, so a
bfloat16 source is gathered from a float32 copy made by XLA (exact; costs one extra pass over the source),
while the output block keeps the source dtype.

R (`block_rows`): the largest power of two in [16, 256] whose k * R float32 row buffer stays within 1 MiB (16
is a multiple of bf16's 16-row sublane tile of the output block). The index tables are O(num_slots) and O(k * S) int32 in SMEM:
`check_supported` declines calls whose table exceeds MAX_TABLE entries (then "auto" uses the XLA reference).
Like every Mosaic kernel, these run inside `shard_map` on a multi-device mesh (see `gmm.pallas_mosaic_tpu.check_supported`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._manual import require_manual_axes, run_manual
from .._select import NotSupported
from .._util import cdiv
from ._reference import slot_owner

__all__ = ["encode_tpu", "decode_tpu", "gather_rows_tpu", "check_supported", "default_block_rows", "MAX_TABLE",
           "BUFFER_BYTES"]

#: largest scalar-prefetched index table (int32 entries): 512 KiB of the 1 MiB SMEM (a 2**18-entry table fails to
#: compile for v5e: SMEM exhausted)
MAX_TABLE = 1 << 17
#: VMEM budget of one step's gathered rows
BUFFER_BYTES = 1 << 20
MIN_ROWS, MAX_ROWS = 16, 256


def default_block_rows(model_dim: int, itemsize: int, k: int = 1) -> int:
    """Output rows per grid step: the largest power of two in [16, 256] with k * R * M * itemsize <= 1 MiB."""
    rows = MAX_ROWS
    while rows > MIN_ROWS and k * rows * max(model_dim, 1) * itemsize > BUFFER_BYTES:
        rows //= 2
    return rows


def check_supported(table_entries: int, dtype: Any, interpret: bool = False) -> None:
    """Raises NotSupported when the TPU dispatch kernels cannot run a call.

    Args:
      table_entries: the larger index table of the call and of its backward (max(num_slots, k * S)).
      dtype: the rows' dtype (float32 or bfloat16; Mosaic's DMA and VPU handle other floats poorly on v5).
      interpret: the interpreter skips the mesh rule (see `gmm.pallas_mosaic_tpu.check_supported`).
    """
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise NotSupported(f"the TPU dispatch kernels take float32 or bfloat16 rows, got {jnp.dtype(dtype)}")
    if table_entries > MAX_TABLE:
        raise NotSupported(f"index table of {table_entries} entries exceeds the SMEM budget ({MAX_TABLE})")
    if not interpret:
        require_manual_axes()


def _gather_kernel(index_ref, keep_ref, w_ref, src_hbm, out_ref, buf, sem, *, k, rows, padded_rows):
    """out[r] = sum_j keep[j, r] ? w[j, r] * src[index[j * padded_rows + i * rows + r]] : 0 (float32 math)."""
    base = pl.program_id(0) * rows

    def copy(j, r):
        source = jnp.maximum(index_ref[j * padded_rows + base + r], 0)
        return pltpu.make_async_copy(src_hbm.at[pl.ds(source, 1)], buf.at[j, pl.ds(r, 1)], sem.at[0])

    def has_source(j, r):
        return index_ref[j * padded_rows + base + r] >= 0

    for j in range(k):  # k is small (top-k); the row loop stays rolled
        def start(r, carry, j=j):
            @pl.when(has_source(j, r))
            def _():
                copy(j, r).start()
            return carry

        jax.lax.fori_loop(0, rows, start, 0)
    for j in range(k):
        def wait(r, carry, j=j):
            @pl.when(has_source(j, r))
            def _():
                copy(j, r).wait()
            return carry

        jax.lax.fori_loop(0, rows, wait, 0)
    acc = jnp.zeros(out_ref.shape, jnp.float32)
    for j in range(k):  # choice order, like the reference
        term = buf[j].astype(jnp.float32) * w_ref[j]
        acc = acc + jnp.where(keep_ref[j] > 0, term, 0.0)
    out_ref[...] = acc.astype(out_ref.dtype)


def gather_rows_tpu(src: jax.Array, index: jax.Array, weights: jax.Array, num_rows: int, *,
                    interpret: bool = False, block_rows: int | None = None) -> jax.Array:
    """The shared kernel: out[r] = sum_j weights[j, r] * src[index[j, r]] over the j with index[j, r] >= 0.

    Args:
      src: [N, M] float32 / bfloat16 rows (stays in HBM).
      index: [k, num_rows] int32 source row of each term; negative: no term (adds zero).
      weights: [k, num_rows] float32 multiplier of each term (applied in float32).
      num_rows: output rows.
      interpret: run through Pallas' interpreter (CPU).
      block_rows: output rows per grid step, a multiple of 8 (default `default_block_rows`).

    Returns:
      [num_rows, M] in src's dtype, accumulated in float32 over j in order.
    """
    k = index.shape[0]
    dim = src.shape[1]
    out_dtype = src.dtype
    if num_rows == 0 or dim == 0 or k == 0 or src.shape[0] == 0:  # no term at all: zeros
        return jnp.zeros((num_rows, dim), out_dtype)
    # Mosaic DMAs a single row only into a 32-bit VMEM buffer (16-bit rows are packed two per sublane, so a
    # one-row destination offset is unaligned): 16-bit rows are gathered from a float32 copy (exact)
    src = src.astype(jnp.float32)
    rows = block_rows or default_block_rows(dim, src.dtype.itemsize, k)
    if not isinstance(rows, int) or rows <= 0 or rows % 8:
        raise ValueError(f"block_rows must be a positive multiple of 8, got {block_rows!r}")
    steps = cdiv(num_rows, rows)
    padded = steps * rows
    pad = ((0, 0), (0, padded - num_rows))
    index = jnp.pad(index.astype(jnp.int32), pad, constant_values=-1)
    keep = (index >= 0).astype(jnp.float32)[:, :, None]
    weights = jnp.pad(weights.astype(jnp.float32), pad)[:, :, None]
    kernel = partial(_gather_kernel, k=k, rows=rows, padded_rows=padded)
    column = pl.BlockSpec((k, rows, 1), lambda i, idx: (0, i, 0))
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_rows, dim), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(steps,),
            in_specs=[column, column, pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((rows, dim), lambda i, idx: (i, 0)),
            scratch_shapes=[pltpu.VMEM((k, rows, dim), src.dtype), pltpu.SemaphoreType.DMA((1,))],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name="tutel_tpu_gather_rows",
    )
    return run_manual(lambda i, kp, w, s: call(i.reshape(-1), kp, w, s), index, keep, weights, src)


def encode_tpu(x: jax.Array, weights: jax.Array, slots: jax.Array, num_slots: int, *, interpret: bool = False,
               block_rows: int | None = None) -> jax.Array:
    """encode on TPU: [S, M] -> [num_slots, M] (see the module docstring). Slots must be distinct."""
    k, num_tokens = weights.shape
    num_assign = k * num_tokens
    owner = slot_owner(slots, num_slots)
    filled = owner < num_assign
    token = jnp.where(filled, owner % max(num_tokens, 1), -1)
    # the weight rounded to x's dtype, as the reference multiplies in that dtype
    w = jnp.take(weights.reshape(-1), jnp.minimum(owner, max(num_assign - 1, 0)), mode="clip") \
        if num_assign else jnp.zeros((num_slots,), weights.dtype)
    w = jnp.where(filled, w.astype(x.dtype).astype(jnp.float32), 0.0)
    return gather_rows_tpu(x, token[None], w[None], num_slots, interpret=interpret, block_rows=block_rows)


def decode_tpu(data: jax.Array, weights: jax.Array, slots: jax.Array, *, interpret: bool = False,
               block_rows: int | None = None) -> jax.Array:
    """decode on TPU: [num_slots, M] -> [S, M] (see the module docstring)."""
    num_slots = data.shape[0]
    slots = slots.astype(jnp.int32)
    kept = (slots >= 0) & (slots < num_slots)
    index = jnp.where(kept, slots, -1)
    w = jnp.where(kept, weights.astype(data.dtype).astype(jnp.float32), 0.0)
    return gather_rows_tpu(data, index, w, weights.shape[1], interpret=interpret, block_rows=block_rows)
