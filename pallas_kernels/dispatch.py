"""Dispatch (encode), combine (decode) and the dropless permute/unpermute pair, with custom VJPs.

Ops (reference semantics: `tutel_jax/dispatch.py`):
  encode(x[S, M], weights[k, S], slots[k, S], num_slots) -> [num_slots, M]
      out[slot] = weights[j, s] * x[s] for the assignment (j, s) owning the slot, zeros for an empty slot;
      a slot value outside [0, num_slots) means the assignment is dropped.
  decode(data[num_slots, M], weights[k, S], slots[k, S]) -> [S, M]
      y[s] = sum_j weights[j, s] * data[slots[j, s]] (dropped assignments add nothing).
  permute / unpermute: the same pair on the dropless grouped layout [k*S, M] (rows sorted by expert, see
      `grouped_rows`), where every row is owned by exactly one assignment.
The capacity buffer [E, C, M] is the flat [E*C, M] layout with slot = expert * C + location.

Kernels (Triton backend) -- all gathers, no atomics (Pallas' interpreter mishandles duplicate atomic indices,
and gathers are deterministic):
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

On TPUs ("tpu" / "tpu_interpret") encode and decode run the Mosaic row-gather kernel of `tpu_dispatch.py`
(scalar-prefetched index table, one DMA per gathered row; `config` is the Triton tiling and does not apply);
the row dots of the weight gradients run their XLA reference there.

Backward: encode and decode are each other's transpose (dx = decode(g), ddata = encode(g)), and the weight
gradients are the row dots, so backward is as cheap as forward and never forms a one-hot.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from . import tpu_dispatch
from .tpu_gmm import sum_to_primal_vma
from ._select import TPU_IMPLEMENTATIONS, choose, resolved_name
from ._util import cdiv, check_pow2, col, row, triton_call
from .targets import current_target, get_target

__all__ = ["DispatchConfig", "encode", "decode", "permute", "unpermute", "grouped_rows", "encode_reference",
           "decode_reference", "row_dots_reference", "default_dispatch_config", "DispatchTiling",
           "DISPATCH_TILINGS", "row_dots_config"]


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


# ----------------------------------------------------------------------------------------------- reference


def _slot_owner(slots: jax.Array, num_slots: int) -> jax.Array:
    """[num_slots] int32: index into the flattened [k*S] assignments owning each slot (k*S when empty)."""
    num_assign = slots.size
    owner = jnp.full((num_slots,), num_assign, jnp.int32)
    return owner.at[slots.reshape(-1)].set(jnp.arange(num_assign, dtype=jnp.int32), mode="drop")


def encode_reference(x: jax.Array, weights: jax.Array, slots: jax.Array, num_slots: int) -> jax.Array:
    """XLA encode: [S, M] -> [num_slots, M]; `tutel_jax.dispatch.encode` (the library's gathers are the
    reference the kernels must equal)."""
    from tutel_jax.dispatch import encode  # lazy: this package imports without the library loaded

    return encode(x, weights, slots, num_slots)


def decode_reference(data: jax.Array, weights: jax.Array, slots: jax.Array) -> jax.Array:
    """XLA decode: [num_slots, M] -> [S, M], summed in choice order in data's dtype (like Tutel);
    `tutel_jax.dispatch.decode`."""
    from tutel_jax.dispatch import decode

    return decode(data, weights, slots)


def row_dots_reference(a: jax.Array, b: jax.Array, slots: jax.Array) -> jax.Array:
    """[k, S] float32: <a[s], b[slots[j, s]]>, zero where the slot is out of range."""
    dots = []
    for j in range(slots.shape[0]):
        rows = jnp.take(b, slots[j], axis=0, mode="fill", fill_value=0)
        dots.append(jnp.sum(a.astype(jnp.float32) * rows.astype(jnp.float32), axis=-1))
    return jnp.stack(dots)


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


def _encode_kernel(x, weights, slots, num_slots, cfg, interpret):
    k, num_tokens = weights.shape
    dim = x.shape[1]
    owner = _slot_owner(slots, num_slots)
    empty = owner >= k * num_tokens
    token = jnp.where(empty, num_tokens, owner % num_tokens).astype(jnp.int32)
    w_slot = jnp.where(empty, 0, jnp.take(weights.reshape(-1), jnp.minimum(owner, k * num_tokens - 1)))
    kernel = partial(_gather_rows_kernel, num_tokens=num_tokens, dim=dim, br=cfg.block_rows, bc=cfg.block_cols)
    return triton_call(kernel, out_shape=jax.ShapeDtypeStruct((num_slots, dim), x.dtype),
                       grid=(cdiv(num_slots, cfg.block_rows), cdiv(dim, cfg.block_cols)),
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages, interpret=interpret,
                       name="tutel_encode")(token, w_slot.astype(x.dtype), x)  # weights rounded like XLA's


def _decode_kernel(data, weights, slots, cfg, interpret):
    k, num_tokens = weights.shape
    num_slots, dim = data.shape
    kernel = partial(_combine_kernel, num_slots=num_slots, dim=dim, k=k, br=cfg.block_rows, bc=cfg.block_cols)
    return triton_call(kernel, out_shape=jax.ShapeDtypeStruct((num_tokens, dim), data.dtype),
                       grid=(cdiv(num_tokens, cfg.block_rows), cdiv(dim, cfg.block_cols)),
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages, interpret=interpret,
                       name="tutel_decode")(slots.astype(jnp.int32), weights, data)


def _row_dots_kernel_call(a, b, slots, cfg, interpret):
    k, num_tokens = slots.shape
    num_slots, dim = b.shape
    cfg = row_dots_config(cfg, k, max(a.dtype.itemsize, b.dtype.itemsize))
    kernel = partial(_row_dots_kernel, num_tokens=num_tokens, num_slots=num_slots, dim=dim, k=k,
                     br=cfg.block_rows, bc=cfg.block_cols)
    return triton_call(kernel, out_shape=jax.ShapeDtypeStruct((k, num_tokens), jnp.float32),
                       grid=(cdiv(num_tokens, cfg.block_rows),), num_warps=cfg.num_warps,
                       num_stages=cfg.num_stages, interpret=interpret, name="tutel_row_dots")(slots, a, b)


# ------------------------------------------------------------------------------------ custom VJPs and ops


def _fwd_encode(impl, cfg, x, weights, slots, num_slots):
    if impl == "xla":
        return encode_reference(x, weights, slots, num_slots)
    if impl in TPU_IMPLEMENTATIONS:
        return tpu_dispatch.encode_tpu(x, weights, slots, num_slots, interpret=impl == "tpu_interpret")
    return _encode_kernel(x, weights, slots, num_slots, cfg, impl == "interpret")


def _fwd_decode(impl, cfg, data, weights, slots):
    if impl == "xla":
        return decode_reference(data, weights, slots)
    if impl in TPU_IMPLEMENTATIONS:
        return tpu_dispatch.decode_tpu(data, weights, slots, interpret=impl == "tpu_interpret")
    return _decode_kernel(data, weights, slots, cfg, impl == "interpret")


def _row_dots(impl, cfg, a, b, slots):
    if impl == "xla" or impl in TPU_IMPLEMENTATIONS:  # no TPU kernel: XLA's gather + reduce
        return row_dots_reference(a, b, slots)
    return _row_dots_kernel_call(a, b, slots.astype(jnp.int32), cfg, impl == "interpret")


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 5))
def _encode(impl, cfg, x, weights, slots, num_slots):
    return _fwd_encode(impl, cfg, x, weights, slots, num_slots)


def _encode_vjp_fwd(impl, cfg, x, weights, slots, num_slots):
    return _fwd_encode(impl, cfg, x, weights, slots, num_slots), (x, weights, slots)


def _encode_vjp_bwd(impl, cfg, num_slots, res, g):
    x, weights, slots = res
    dx = _fwd_decode(impl, cfg, g, weights, slots).astype(x.dtype)
    dw = _row_dots(impl, cfg, x, g, slots).astype(weights.dtype)
    return sum_to_primal_vma(dx, x), sum_to_primal_vma(dw, weights), None


_encode.defvjp(_encode_vjp_fwd, _encode_vjp_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _decode(impl, cfg, data, weights, slots):
    return _fwd_decode(impl, cfg, data, weights, slots)


def _decode_vjp_fwd(impl, cfg, data, weights, slots):
    return _fwd_decode(impl, cfg, data, weights, slots), (data, weights, slots)


def _decode_vjp_bwd(impl, cfg, res, g):
    data, weights, slots = res
    ddata = _fwd_encode(impl, cfg, g, weights, slots, data.shape[0]).astype(data.dtype)
    dw = _row_dots(impl, cfg, g, data, slots).astype(weights.dtype)
    return sum_to_primal_vma(ddata, data), sum_to_primal_vma(dw, weights), None


_decode.defvjp(_decode_vjp_fwd, _decode_vjp_bwd)


def _tpu_check(implementation, num_slots: int, weights: jax.Array, dtype):
    """The TPU kernels' check for `choose`; it covers the backward too (encode <-> decode, same tables)."""
    interpret = resolved_name(implementation) == "tpu_interpret"
    entries = max(int(num_slots), int(weights.size))
    return lambda: tpu_dispatch.check_supported(entries, dtype, interpret=interpret)


def _check(x: jax.Array, weights: jax.Array, slots: jax.Array, what: str) -> None:
    if x.ndim != 2:
        raise ValueError(f"{what} must be 2-D [rows, M], got shape {x.shape}")
    if weights.ndim != 2 or slots.shape != weights.shape:
        raise ValueError(f"weights and slots must both be [k, S], got {weights.shape} and {slots.shape}")


def encode(
    x: jax.Array,
    weights: jax.Array,
    slots: jax.Array,
    num_slots: int,
    *,
    implementation: str | None = "auto",
    config: DispatchConfig | None = None,
) -> jax.Array:
    """Scatters tokens into slots by gathering (differentiable in x and weights).

    Args:
      x: [S, M] tokens.
      weights: [k, S] weight applied to each assignment.
      slots: [k, S] int32 flat slot of each assignment; outside [0, num_slots) means dropped. Slots must be
        distinct (a routing plan guarantees it).
      num_slots: rows of the output (E * C for the capacity buffer).
      implementation: "auto", "xla", "pallas", "interpret", "tpu" or "tpu_interpret".
      config: kernel tiling (default: `default_dispatch_config`).

    Returns:
      [num_slots, M] in x's dtype; an empty slot holds zeros.
    """
    _check(x, weights, slots, "x")
    if weights.shape[1] != x.shape[0]:
        raise ValueError(f"weights [k, S] must match x's S={x.shape[0]}, got {weights.shape}")
    impl = choose(implementation, tpu=_tpu_check(implementation, num_slots, weights, x.dtype))
    cfg = config or default_dispatch_config(x.shape[1], x.dtype)
    return _encode(impl, cfg, x, weights, slots, int(num_slots))


def decode(
    data: jax.Array,
    weights: jax.Array,
    slots: jax.Array,
    *,
    implementation: str | None = "auto",
    config: DispatchConfig | None = None,
) -> jax.Array:
    """Combines slot rows back into tokens (differentiable in data and weights).

    Args:
      data: [num_slots, M] expert outputs.
      weights: [k, S] combine weights.
      slots: [k, S] int32 flat slots; out of range means dropped (contributes zero).
      implementation: "auto", "xla", "pallas", "interpret", "tpu" or "tpu_interpret".
      config: kernel tiling (default: `default_dispatch_config`).

    Returns:
      [S, M] in data's dtype, `y[s] = sum_j weights[j, s] * data[slots[j, s]]` (the kernel accumulates in
      float32; the reference, like Tutel, in data's dtype).
    """
    _check(data, weights, slots, "data")
    impl = choose(implementation, tpu=_tpu_check(implementation, data.shape[0], weights, data.dtype))
    cfg = config or default_dispatch_config(data.shape[1], data.dtype)
    return _decode(impl, cfg, data, weights, slots)


def grouped_rows(expert_ids: jax.Array, locations: jax.Array, counts: jax.Array) -> jax.Array:
    """[k, S] row of each assignment in the dropless layout [k*S, M] sorted by expert (group sizes = counts).

    Same as `tutel_jax.dispatch.grouped_slots`: start(expert) + Tutel location.
    """
    starts = jnp.cumsum(counts) - counts
    return (starts[expert_ids] + locations).astype(jnp.int32)


def permute(x: jax.Array, weights: jax.Array, rows: jax.Array, *, implementation: str | None = "auto",
            config: DispatchConfig | None = None) -> jax.Array:
    """Dropless dispatch: [S, M] -> [k*S, M] rows sorted by expert (`rows` from `grouped_rows`).

    `weights` scales each copy (pass ones for Tutel's postscore mode)."""
    return encode(x, weights, rows, weights.size, implementation=implementation, config=config)


def unpermute(y: jax.Array, weights: jax.Array, rows: jax.Array, *, implementation: str | None = "auto",
              config: DispatchConfig | None = None) -> jax.Array:
    """Dropless combine: [k*S, M] expert outputs sorted by expert -> [S, M]."""
    return decode(y, weights, rows, implementation=implementation, config=config)
