"""Fused gating on Pallas Triton kernels (NVIDIA, AMD): `gating_triton` and `slot_positions_triton`; semantics
are _reference.py's.

Kernel family (Triton backend), three steps, no atomics:
  1. `_gating_kernel`, grid over blocks of `block_tokens` tokens: each program loads its [BT, W] logits tile
     (W: E padded to a power of two, masked; with groups of a size that is no power of two, each group padded
     on its own, see `_expert_layout`), computes the scores, the group mask (on the [BT, groups, group width]
     view of the tile: no per-group copy) and k rounds of "max, lowest index attaining it, knock it out"; in
     each round it stores the choice, the rank of each token among the block's tokens with the same expert (a
     [BT, BT] comparison, independent of E) and the block's per-expert counts [k, nb, E], so nothing of a
     round stays live in registers but its weight.
  2. XLA: an exclusive cumsum of the small [k * nb, E] count table in (choice, block) order: the number of
     assignments that precede each (choice, block) pair for every expert. This is Tutel's cumsum, done on
     block totals instead of on an [S, E] one-hot.
  3. `_locate_kernel`: location = in-block rank + offset[(choice, block), expert] (one gather per choice).
The scores tile stays in registers: W <= 1024 is supported (wider falls back to XLA under "auto").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from .._select import NotSupported
from .._util import cdiv, check_pow2, col, next_pow2, row, triton_call
from ..targets import current_target, get_target
from ._reference import GatingResult, priority_order

__all__ = ["GatingConfig", "default_gating_config", "MAX_KERNEL_EXPERTS", "GatingTiling", "GATING_TILINGS",
           "tiling_candidates", "gating_triton", "slot_positions_triton", "check_kernel_experts"]

#: largest expert count the gating kernel keeps in one register tile
MAX_KERNEL_EXPERTS = 1024


@dataclasses.dataclass(frozen=True)
class GatingConfig:
    """Tiling of the gating kernels.

    Attributes:
      block_tokens: tokens per program (power of two, >= 8). The [block_tokens, W] score tile (W: the experts
        padded to a power of two) lives in registers, a few copies of it at a time; `default_gating_config` sizes
        it from the target's `GatingTiling`.
      num_warps, num_stages: Triton launch parameters.
    """

    block_tokens: int = 32
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        check_pow2("block_tokens", self.block_tokens, 8)
        check_pow2("num_warps", self.num_warps)


@dataclasses.dataclass(frozen=True)
class GatingTiling:
    """How a target sizes the gating kernel's [block_tokens, W] register tile.

    Attributes:
      thread_elements: tile elements per thread (the tile spreads over num_warps * warp_size threads). The
        kernel keeps the scores and the selection scores live through the k rounds, plus the round's masks
        (held in SGPR pairs on AMD, so AMD wants fewer per thread); more than this spills.
      grouped_thread_elements: the same for group-limited routing (a bias tile and the group step as well).
      max_block_tokens: block_tokens at most: each round compares the block's tokens pairwise ([BT, BT]).
      max_warps: warps at most. A program has 4 warps at least; past the [8 tokens, W] tile at max_warps the
        thread budget is exceeded (E = 1024: 32 elements per CUDA thread, which still fits).
    """

    thread_elements: int = 16
    grouped_thread_elements: int = 16
    max_block_tokens: int = 64
    max_warps: int = 8


#: per target (see targets.py); the values are chosen with the offline compile report (no register spills)
GATING_TILINGS: dict[str, GatingTiling] = {
    "sm_80": GatingTiling(),
    "sm_90": GatingTiling(),
    "sm_100": GatingTiling(),
    "gfx942": GatingTiling(thread_elements=8, grouped_thread_elements=8),  # wave64: the same tiles as CUDA
}

_MIN_BLOCK_TOKENS = 8


def default_gating_config(num_tokens: int, num_experts: int, grouped: bool = False, target: str | None = None
                          ) -> GatingConfig:
    """The largest [BT, W] tile within the target's thread budget (`GATING_TILINGS`) at its most warps, BT in
    [8, max_block_tokens] and not above the tokens, then the fewest warps (>= 4) holding it within the budget."""
    spec = get_target(target) if target else current_target()
    tiling = GATING_TILINGS[spec.name]
    width = next_pow2(num_experts)
    per_thread = tiling.grouped_thread_elements if grouped else tiling.thread_elements
    budget = per_thread * spec.warp_size * tiling.max_warps  # tile elements of a program at max_warps
    bt = min(tiling.max_block_tokens, max(_MIN_BLOCK_TOKENS, budget // width),
             max(_MIN_BLOCK_TOKENS, next_pow2(num_tokens)))
    bt = 1 << (bt.bit_length() - 1)
    warps = next_pow2(cdiv(bt * width, per_thread * spec.warp_size))
    return GatingConfig(block_tokens=bt, num_warps=min(tiling.max_warps, max(4, warps)))


def tiling_candidates(target: str) -> dict[str, GatingConfig]:
    """The configs `default_gating_config` picks for `target` at 512 tokens for the expert counts of the model
    families (and the kernel's limit), keyed "softmax_e{E}" / "grouped_e{E}"."""
    candidates = {f"softmax_e{e}": default_gating_config(512, e, target=target) for e in (8, 32, 128, 256, 1024)}
    candidates["grouped_e256"] = default_gating_config(512, 256, grouped=True, target=target)
    return candidates


# ------------------------------------------------------------------------------------------------- kernels


def _rank_and_count(ids: jax.Array, valid: jax.Array, cols: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For one choice: each token's rank among the block's earlier tokens with the same expert, and the
    block's per-expert counts. [BT] ids, [W] cols -> ([BT] int32, [W] int32)."""
    bt = ids.shape[0]
    pos = jnp.arange(bt, dtype=jnp.int32)
    earlier = (pos[:, None] < pos[None, :]) & valid[:, None]  # [t', t]: t' placed before t
    same = (ids[:, None] == ids[None, :]) & earlier
    rank = jnp.sum(same.astype(jnp.int32), axis=0)
    onehot = (ids[:, None] == cols[None, :]) & valid[:, None]
    return rank, jnp.sum(onehot.astype(jnp.int32), axis=0)


def _expert_layout(num_experts: int, n_group: int) -> tuple[int, int, int]:
    """The gating tile's columns: (padded groups GP, padded group width GS, tile width W = GP * GS).

    Column c holds expert (c // GS) * (E / n_group) + c % GS when c % GS < E / n_group and c // GS < n_group
    (padding otherwise): each group fills GS contiguous columns, so the tile reshapes to [BT, GP, GS] for the
    group scores, and experts grow with the column, so "lowest column" is "lowest expert" (the tie rule). With
    n_group == 1, or power-of-two groups, it is the plain layout: column c holds expert c < E."""
    groups = next_pow2(n_group)
    width = next_pow2(num_experts // n_group)
    return groups, width, groups * width


def _column_experts(cols: jax.Array, num_experts: int, n_group: int) -> tuple[jax.Array, jax.Array]:
    """Expert held by each column of `cols` (any shape; see `_expert_layout`) and whether it holds one."""
    gsize = num_experts // n_group
    _, gs, _ = _expert_layout(num_experts, n_group)
    if gs == gsize or n_group == 1:  # no padding inside the groups: column == expert
        return cols, cols < num_experts
    group, member = cols // gs, cols % gs
    return group * gsize + member, (group < n_group) & (member < gsize)


def _group_limit(sel: jax.Array, n_group: int, topk_group: int, gs: int, fill: float) -> jax.Array:
    """Keeps the selection scores of each token's best `topk_group` groups (group score: the sum of its two best
    selection scores; ties to the lower group) and puts `fill` elsewhere. Works on the [BT, GP, GS] view of the
    tile, so no per-group copy of the tile is formed. Padding columns of `sel` must hold -inf."""
    bt, w = sel.shape
    groups = w // gs
    neg = jnp.float32(-jnp.inf)
    sel3 = sel.reshape(bt, groups, gs)
    member = jnp.arange(gs, dtype=jnp.int32)[None, None, :]
    top1 = jnp.max(sel3, axis=2)
    first = jnp.min(jnp.where(sel3 == top1[:, :, None], member, gs), axis=2)  # lowest member attaining it
    top2 = jnp.max(jnp.where(member == first[:, :, None], neg, sel3), axis=2)
    group_scores = top1 + top2  # [BT, GP]
    gidx = jnp.arange(groups, dtype=jnp.int32)[None, :]
    real = gidx < n_group
    chosen = jnp.zeros((bt, groups), jnp.bool_)
    for _ in range(topk_group):
        avail = jnp.where(chosen, neg, group_scores)
        best = jnp.max(jnp.where(real, avail, neg), axis=1, keepdims=True)
        pick = jnp.min(jnp.where((avail == best) & real, gidx, groups), axis=1, keepdims=True)
        chosen = chosen | (gidx == pick)
    keep = jnp.broadcast_to(chosen[:, :, None], (bt, groups, gs)).reshape(bt, w)
    return jnp.where(keep, sel, jnp.float32(fill))


def _gating_kernel(logits_ref, bias_ref, ids_ref, w_ref, rank_ref, counts_ref, scores_ref, *,
                   num_tokens, num_experts, bt, k, score_fn, use_bias, n_group, topk_group, fill,
                   normalize, scale):
    b = pl.program_id(0)
    rows = b * bt + jnp.arange(bt, dtype=jnp.int32)
    valid = rows < num_tokens
    _, gs, width = _expert_layout(num_experts, n_group)
    cols = jnp.arange(width, dtype=jnp.int32)  # the tile's columns; selection works on columns
    experts, cmask = _column_experts(cols, num_experts, n_group)  # memory accesses use experts
    last_col = (n_group - 1) * gs + num_experts // n_group - 1  # the column of expert E - 1
    neg = jnp.float32(-jnp.inf)

    x = plt.load(logits_ref.at[row(rows), col(experts)], mask=valid[:, None] & cmask[None, :],
                 other=0).astype(jnp.float32)
    if score_fn == "softmax":
        x = jnp.where(cmask[None, :], x, neg)  # padded experts get probability exactly 0
        e = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))
        scores = e / jnp.sum(e, axis=1, keepdims=True)
    else:
        scores = jax.nn.sigmoid(x)
    # every output is stored as soon as it is known: no store mask or result stays live across the selection
    plt.store(scores_ref.at[row(rows), col(experts)], scores, mask=valid[:, None] & cmask[None, :])
    sel = scores
    if use_bias:
        sel = sel + plt.load(bias_ref.at[experts], mask=cmask, other=0).astype(jnp.float32)[None, :]
    sel = jnp.where(cmask[None, :], sel, neg)
    if n_group > 1:
        sel = jnp.where(cmask[None, :], _group_limit(sel, n_group, topk_group, gs, fill), neg)

    # Each round stores its choice, ranks and counts, and takes its weight without a mask where it can: a mask
    # or result kept for after the loop stays live through the remaining rounds (AMD's scheduler sinks such a
    # select to its use and holds the k hit masks in SGPR pairs, which spill).
    weights = []
    for j in range(k):  # k rounds of "take the best, knock it out"
        best = jnp.max(sel, axis=1, keepdims=True)
        idx = jnp.min(jnp.where(sel == best, cols[None, :], width), axis=1)  # lowest column: lax.top_k's tie rule
        idx = jnp.minimum(idx, last_col)  # clamp: a NaN row stays in range
        hit = cols[None, :] == idx[:, None]
        if use_bias or n_group > 1:  # the weight is the unbiased score of the choice
            weights.append(jnp.sum(jnp.where(hit, scores, 0.0), axis=1))
        else:  # selection scores are the scores: the best is the choice's score, exactly
            weights.append(best[:, 0])
        sel = jnp.where(hit, neg, sel)
        plt.store(ids_ref.at[j, rows], _column_experts(idx, num_experts, n_group)[0], mask=valid)
        rank, count = _rank_and_count(idx, valid, cols)  # by column: the same thing as by expert
        plt.store(rank_ref.at[j, rows], rank, mask=valid)
        plt.store(counts_ref.at[j, b, experts], count, mask=cmask)

    total = weights[0]
    for w in weights[1:]:
        total = total + w
    if normalize and score_fn == "softmax" and k > 1:
        denom = jnp.maximum(total, jnp.float32(jnp.finfo(jnp.float32).eps))
        weights = [w / denom for w in weights]
    elif normalize and score_fn == "sigmoid":
        denom = total + jnp.float32(1e-20)
        weights = [w / denom for w in weights]
    if scale != 1.0:
        weights = [w * jnp.float32(scale) for w in weights]
    for j in range(k):
        plt.store(w_ref.at[j, rows], weights[j], mask=valid)


def _rank_kernel(ids_ref, rank_ref, counts_ref, *, num_tokens, num_experts, ep, bt, k):
    b = pl.program_id(0)
    rows = b * bt + jnp.arange(bt, dtype=jnp.int32)
    valid = rows < num_tokens
    cols = jnp.arange(ep, dtype=jnp.int32)
    cmask = cols < num_experts

    def choice(j, carry):  # a loop, not k unrolled copies: one choice's [BT, BT] and [BT, W] work live at a time
        ids = plt.load(ids_ref.at[j, rows], mask=valid, other=0)
        rank, count = _rank_and_count(ids, valid, cols)
        plt.store(rank_ref.at[j, rows], rank, mask=valid)
        plt.store(counts_ref.at[j, b, cols], count, mask=cmask)
        return carry

    lax.fori_loop(0, k, choice, 0)


def _locate_kernel(ids_ref, rank_ref, offsets_ref, loc_ref, *, num_tokens, num_experts, bt, k, nb):
    b = pl.program_id(0)
    rows = b * bt + jnp.arange(bt, dtype=jnp.int32)
    valid = rows < num_tokens
    for j in range(k):
        ids = plt.load(ids_ref.at[j, rows], mask=valid, other=0)
        rank = plt.load(rank_ref.at[j, rows], mask=valid, other=0)
        ok = valid & (ids >= 0) & (ids < num_experts)
        offset = plt.load(offsets_ref.at[j * nb + b, ids], mask=ok, other=0)
        plt.store(loc_ref.at[j, rows], rank + offset, mask=valid)


def _locations_from_blocks(ids, ranks, block_counts, num_experts, cfg, interpret):
    """Steps 2 and 3: exclusive prefix of the block counts, then location = rank + prefix."""
    k, num_tokens = ids.shape
    nb = block_counts.shape[1]
    table = block_counts.reshape(k * nb, num_experts)  # rows in Tutel's precedence: choice, then token block
    offsets = jnp.cumsum(table, axis=0) - table
    counts = jnp.sum(table, axis=0)
    kernel = lambda *refs: _locate_kernel(*refs, num_tokens=num_tokens, num_experts=num_experts,
                                          bt=cfg.block_tokens, k=k, nb=nb)
    locations = triton_call(kernel, out_shape=jax.ShapeDtypeStruct((k, num_tokens), jnp.int32), grid=(nb,),
                            num_warps=cfg.num_warps, num_stages=cfg.num_stages, interpret=interpret,
                            name="tutel_locate")(ids, ranks, offsets)
    return locations, counts


def slot_positions_triton(expert_ids: jax.Array, num_experts: int, cfg: GatingConfig, interpret: bool,
                          priority_order: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """`slot_positions` on the rank and locate kernels: (locations [k, S], counts [E])."""
    expert_ids = expert_ids.astype(jnp.int32)
    if priority_order is not None:  # rank in placement order, then scatter back to token order
        locations, counts = slot_positions_triton(expert_ids[:, priority_order], num_experts, cfg, interpret)
        return jnp.zeros_like(locations).at[:, priority_order].set(locations), counts
    k, num_tokens = expert_ids.shape
    ep, bt = next_pow2(num_experts), cfg.block_tokens
    nb = cdiv(num_tokens, bt)
    kernel = lambda *refs: _rank_kernel(*refs, num_tokens=num_tokens, num_experts=num_experts, ep=ep, bt=bt, k=k)
    ranks, block_counts = triton_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((k, num_tokens), jnp.int32),
                   jax.ShapeDtypeStruct((k, nb, num_experts), jnp.int32)),
        grid=(nb,), num_warps=cfg.num_warps, num_stages=cfg.num_stages, interpret=interpret,
        name="tutel_slot_rank")(expert_ids)
    return _locations_from_blocks(expert_ids, ranks, block_counts, num_experts, cfg, interpret)


def check_kernel_experts(num_experts: int, limit: int, n_group: int = 1):
    def check():
        if _expert_layout(num_experts, n_group)[2] > limit:
            groups = f" in {n_group} groups" if n_group > 1 else ""
            raise NotSupported(f"{num_experts} experts{groups} exceed the kernel's register tile ({limit} columns)")
    return check


def gating_triton(logits: jax.Array, k: int, num_experts: int, n_group: int, topk_group: int, *, score_fn: str,
                  correction_bias: jax.Array | None, group_fill_value: float, normalize: bool,
                  routed_scaling_factor: float, batch_prioritized_routing: bool, cfg: GatingConfig | None,
                  interpret: bool) -> GatingResult:
    """`gating` on the kernel family (arguments checked by the caller, k clipped to E)."""
    num_tokens = logits.shape[0]
    width = _expert_layout(num_experts, n_group)[2]  # the tile's columns
    cfg = cfg or default_gating_config(num_tokens, width, grouped=n_group > 1)
    bt = cfg.block_tokens
    nb = cdiv(num_tokens, bt)
    bias = jnp.zeros((num_experts,), jnp.float32) if correction_bias is None else correction_bias
    kernel = lambda *refs: _gating_kernel(
        *refs, num_tokens=num_tokens, num_experts=num_experts, bt=bt, k=k, score_fn=score_fn,
        use_bias=correction_bias is not None, n_group=n_group, topk_group=topk_group,
        fill=float(group_fill_value), normalize=bool(normalize), scale=float(routed_scaling_factor))
    ids, weights, ranks, block_counts, scores = triton_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((k, num_tokens), jnp.int32),
                   jax.ShapeDtypeStruct((k, num_tokens), jnp.float32),
                   jax.ShapeDtypeStruct((k, num_tokens), jnp.int32),
                   jax.ShapeDtypeStruct((k, nb, num_experts), jnp.int32),
                   jax.ShapeDtypeStruct((num_tokens, num_experts), jnp.float32)),
        grid=(nb,), num_warps=cfg.num_warps, num_stages=cfg.num_stages, interpret=interpret,
        name="tutel_gating")(logits, bias)
    if batch_prioritized_routing:  # the placement order depends on all tokens: re-rank in that order
        locations, counts = slot_positions_triton(ids, num_experts, cfg, interpret, priority_order(scores))
    else:
        locations, counts = _locations_from_blocks(ids, ranks, block_counts, num_experts, cfg, interpret)
    return GatingResult(ids, locations, weights, counts, scores)
