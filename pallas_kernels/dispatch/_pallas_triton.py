"""Dispatch (encode), combine (decode) and their weight gradients (row dots) on Pallas Triton kernels, forward
only (_api.py adds the custom VJPs). Semantics are _reference.py's.

Kernels -- all gathers, no atomics (Pallas' interpreter mishandles duplicate atomic indices, and gathers are
deterministic):
  - `_gather_rows_kernel` (encode): the owner of each slot is found first by an integer scatter of k*S indices
    in XLA (O(kS) int32, negligible next to the rows); then each program copies a [block_rows, block_cols]
    tile: token = owner % S, one gathered row per slot, times its weight.
  - `_combine_kernel` (decode): each program owns [block_rows tokens, block_cols]; it gathers the k source
    rows and accumulates them in float32 in choice order.
  - `_row_dots_kernel` (weight gradients): <a[s], b[slot_j(s)]> per assignment, float32. Its column steps hold
    k + 1 tiles in flight, so it runs on a smaller block than the config's (`row_dots_config`, per target).
Intended tiling for bandwidth (target: >= 50% of a device copy): 32 rows x 256 bf16 columns per program
(16 KiB in + 16 KiB out, 512-byte contiguous row segments), 4 warps; the grid is (row blocks, column
blocks) so the row index vectors are tiny and each row segment is one coalesced access.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from .._util import cdiv, check_pow2, col, row, triton_call
from ..targets import current_target, get_target
from ._reference import slot_owner

__all__ = ["DispatchConfig", "default_dispatch_config", "DispatchTiling", "DISPATCH_TILINGS",
           "row_dots_config", "encode_triton", "decode_triton", "row_dots_triton"]


@dataclasses.dataclass(frozen=True)
class DispatchConfig:
    """Tiling of the dispatch kernels: block_rows x block_cols elements per program (powers of two)."""

    block_rows: int = 32
    block_cols: int = 256
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        check_pow2("block_rows", self.block_rows)
        check_pow2("block_cols", self.block_cols)
        check_pow2("num_warps", self.num_warps)


def default_dispatch_config(model_dim: int, dtype) -> DispatchConfig:
    """512-byte row segments (coalesced), 32 rows: 16 KiB moved each way per program."""
    cols = max(16, min(512 // jnp.dtype(dtype).itemsize, 1 << (max(model_dim, 1) - 1).bit_length()))
    return DispatchConfig(block_rows=32, block_cols=cols)


@dataclasses.dataclass(frozen=True)
class DispatchTiling:
    """How a target shrinks the dispatch config for the row-dots kernel (the weight gradients).

    Each column step of `_row_dots_kernel` gathers k rows of b next to the row of a, all in flight at once: the
    step's tiles take (k + 1) * block_rows * block_cols elements, k + 1 times what encode and decode hold.

    Attributes:
      row_dots_rows: block_rows at most (more programs: the grid has no column axis).
      row_dots_thread_bytes: bytes each thread loads per column step over the k + 1 tiles; block_cols is halved
        until the step fits (k = 8, bf16: 9 tiles of 16 elements, about 110 registers; 9 of 32 spill on CUDA).
    """

    row_dots_rows: int = 16
    row_dots_thread_bytes: int = 384


#: per target (see targets.py); the values are chosen with the offline compile report (no register spills)
DISPATCH_TILINGS: dict[str, DispatchTiling] = {
    "sm_80": DispatchTiling(),
    "sm_90": DispatchTiling(),
    "sm_100": DispatchTiling(),
    "gfx942": DispatchTiling(),
}


def row_dots_config(cfg: DispatchConfig, k: int, itemsize: int, target: str | None = None) -> DispatchConfig:
    """`cfg` for the row-dots kernel of k choices over `itemsize`-byte elements: at most the target's rows, and
    block_cols halved (down to 16, or cfg's own if smaller) until a column step fits the per-thread budget."""
    spec = get_target(target) if target else current_target()
    tiling = DISPATCH_TILINGS[spec.name]
    rows = min(cfg.block_rows, tiling.row_dots_rows)
    budget = tiling.row_dots_thread_bytes * spec.warp_size * cfg.num_warps
    cols = cfg.block_cols
    while cols > 16 and (k + 1) * rows * cols * itemsize > budget:
        cols //= 2
    return dataclasses.replace(cfg, block_rows=rows, block_cols=cols)


# ------------------------------------------------------------------------------------------------- kernels


def _gather_rows_kernel(token_ref, w_ref, x_ref, o_ref, *, num_tokens, dim, br, bc):
    """o[r, c] = w[r] * x[token[r], c]; token == num_tokens marks an empty slot (zeros)."""
    r0, c0 = pl.program_id(0) * br, pl.program_id(1) * bc
    rows = r0 + jnp.arange(br, dtype=jnp.int32)
    cols = c0 + jnp.arange(bc, dtype=jnp.int32)
    rmask = rows < o_ref.shape[0]
    cmask = cols < dim
    token = plt.load(token_ref.at[rows], mask=rmask, other=num_tokens)
    w = plt.load(w_ref.at[rows], mask=rmask, other=0)
    filled = rmask & (token < num_tokens)
    vals = plt.load(x_ref.at[row(token), col(cols)], mask=row(filled) & col(cmask), other=0)
    # the product of two bf16 values is exact in float32, so rounding once equals XLA's bf16 multiply
    out = vals.astype(jnp.float32) * row(w.astype(jnp.float32))
    plt.store(o_ref.at[row(rows), col(cols)], out.astype(o_ref.dtype), mask=row(rmask) & col(cmask))


def _combine_kernel(slots_ref, w_ref, data_ref, o_ref, *, num_slots, dim, k, br, bc):
    """o[s, c] = sum_j w[j, s] * data[slots[j, s], c] in float32."""
    r0, c0 = pl.program_id(0) * br, pl.program_id(1) * bc
    rows = r0 + jnp.arange(br, dtype=jnp.int32)
    cols = c0 + jnp.arange(bc, dtype=jnp.int32)
    rmask = rows < o_ref.shape[0]
    cmask = cols < dim
    acc = jnp.zeros((br, bc), jnp.float32)
    for j in range(k):  # choice order, like the reference
        slot = plt.load(slots_ref.at[j, rows], mask=rmask, other=-1)
        # round the weight to data's dtype first, as the reference multiplies in that dtype
        w = plt.load(w_ref.at[j, rows], mask=rmask, other=0).astype(o_ref.dtype).astype(jnp.float32)
        kept = rmask & (slot >= 0) & (slot < num_slots)
        vals = plt.load(data_ref.at[row(slot), col(cols)], mask=row(kept) & col(cmask), other=0)
        acc = acc + vals.astype(jnp.float32) * row(w)
    plt.store(o_ref.at[row(rows), col(cols)], acc.astype(o_ref.dtype), mask=row(rmask) & col(cmask))


def _row_dots_kernel(slots_ref, a_ref, b_ref, o_ref, *, num_tokens, num_slots, dim, k, br, bc):
    """o[j, s] = <a[s], b[slots[j, s]]> in float32, looping over the columns."""
    rows = pl.program_id(0) * br + jnp.arange(br, dtype=jnp.int32)
    rmask = rows < num_tokens
    slots = [plt.load(slots_ref.at[j, rows], mask=rmask, other=-1) for j in range(k)]
    kept = [rmask & (s >= 0) & (s < num_slots) for s in slots]

    def body(i, accs):
        cols = i * bc + jnp.arange(bc, dtype=jnp.int32)
        cmask = cols < dim
        a = plt.load(a_ref.at[row(rows), col(cols)], mask=row(rmask) & col(cmask), other=0).astype(jnp.float32)
        out = []
        for j in range(k):
            b = plt.load(b_ref.at[row(slots[j]), col(cols)], mask=row(kept[j]) & col(cmask), other=0)
            out.append(accs[j] + jnp.sum(a * b.astype(jnp.float32), axis=1))
        return tuple(out)

    accs = jax.lax.fori_loop(0, cdiv(dim, bc), body, tuple(jnp.zeros((br,), jnp.float32) for _ in range(k)))
    for j in range(k):
        plt.store(o_ref.at[j, rows], accs[j], mask=rmask)


def encode_triton(x, weights, slots, num_slots, cfg, interpret):
    k, num_tokens = weights.shape
    dim = x.shape[1]
    owner = slot_owner(slots, num_slots)
    empty = owner >= k * num_tokens
    token = jnp.where(empty, num_tokens, owner % num_tokens).astype(jnp.int32)
    w_slot = jnp.where(empty, 0, jnp.take(weights.reshape(-1), jnp.minimum(owner, k * num_tokens - 1)))
    kernel = partial(_gather_rows_kernel, num_tokens=num_tokens, dim=dim, br=cfg.block_rows, bc=cfg.block_cols)
    return triton_call(kernel, out_shape=jax.ShapeDtypeStruct((num_slots, dim), x.dtype),
                       grid=(cdiv(num_slots, cfg.block_rows), cdiv(dim, cfg.block_cols)),
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages, interpret=interpret,
                       name="tutel_encode")(token, w_slot.astype(x.dtype), x)  # weights rounded like XLA's


def decode_triton(data, weights, slots, cfg, interpret):
    k, num_tokens = weights.shape
    num_slots, dim = data.shape
    kernel = partial(_combine_kernel, num_slots=num_slots, dim=dim, k=k, br=cfg.block_rows, bc=cfg.block_cols)
    return triton_call(kernel, out_shape=jax.ShapeDtypeStruct((num_tokens, dim), data.dtype),
                       grid=(cdiv(num_tokens, cfg.block_rows), cdiv(dim, cfg.block_cols)),
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages, interpret=interpret,
                       name="tutel_decode")(slots.astype(jnp.int32), weights, data)


def row_dots_triton(a, b, slots, cfg, interpret):
    k, num_tokens = slots.shape
    num_slots, dim = b.shape
    cfg = row_dots_config(cfg, k, max(a.dtype.itemsize, b.dtype.itemsize))
    kernel = partial(_row_dots_kernel, num_tokens=num_tokens, num_slots=num_slots, dim=dim, k=k,
                     br=cfg.block_rows, bc=cfg.block_cols)
    return triton_call(kernel, out_shape=jax.ShapeDtypeStruct((k, num_tokens), jnp.float32),
                       grid=(cdiv(num_tokens, cfg.block_rows),), num_warps=cfg.num_warps,
                       num_stages=cfg.num_stages, interpret=interpret, name="tutel_row_dots")(slots, a, b)
