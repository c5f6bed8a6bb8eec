"""One generation step on device, the same for `generate`, continuous batching and so both server engines.

    toks, finite, logits, cache = prefill_step(apply, params, ids, cache, sampling, pad=pad)       # step 0
    toks, finite, logits, cache = decode_step(apply, params, toks, index, steps, cache, sampling, pad=pad)

A step is the model's forward over a KV cache (`forward_fn`; the layer loop is the model's), each row's last
logits [B, V], a finite check of them (one reduction, read back with the tokens), then the next tokens: the
logit bias added, then the sampler (`sample_rows`). `prefill_step` and `decode_step` are `ModelStep`s (jitted
with the cache donated, or around a model's per-layer programs); `prefill_body` and `decode_body` are their
bodies, for callers that trace them inside a program of their own.

Rows sit in the cache in one of two layouts, chosen by `pad`:
  pad [B] (left padding, `generate`): row b's prompt ends at the last column of the prefill block and its first
    pad[b] slots are padding, masked out of every attention; RoPE positions count real tokens (slot - pad[b]);
  pad None (continuous batching): row b's prompt starts at slot 0 and position = slot (right padding within a
    prefill block is never seen: attention is causal).
Either way a row's tokens equal those of its prompt run alone.

Sampling is per row (`RowSampling`): row b's token n uses the key fold_in(fold_in(key(seed_b), sample_id_b), n)
(`row_keys`), so a row can be reproduced from its seed whatever batch it runs in.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..models import ModelStep, AttnContext
from ._sampling import logit_bias_arrays

__all__ = ["TRACES", "RowSampling", "add_logit_bias", "decode_body", "decode_step", "finite_rows", "prefill_body",
           "prefill_step", "row_keys", "row_sampling", "sample_rows", "sample_step", "sampling_arrays",
           "trim_bias"]

# how many times each step body was traced (= compiled): "decode", "prefill" (a model with per-layer programs
# runs the bodies unjitted: every run counts)
TRACES: collections.Counter = collections.Counter()


class RowSampling(NamedTuple):
    """Per-row sampling parameters of B rows (NumPy or device arrays): seeds [B] uint32 and sample_ids [B] int32
    (each row's key stream), temperature [B] float32 (0: greedy), top_k [B] int32 (<= 0: off), top_p [B]
    float32 (>= 1: off), and the logit bias bias_ids [B, K] int32 / biases [B, K] float32 (unused entries:
    bias 0; K = 0: no bias, the plain program)."""

    seeds: Any
    sample_ids: Any
    temperature: Any
    top_k: Any
    top_p: Any
    bias_ids: Any
    biases: Any


def row_sampling(seed: int, sample_id: int, temperature: float, top_k: int | None, top_p: float | None,
                 logit_bias: Mapping[int, float] | None) -> tuple:
    """One row of `RowSampling` from checked parameters (`sampling.check_sampling`): the seed mod 2**32,
    top_k None -> 0 and top_p None -> 1 (off), the logit bias as MAX_LOGIT_BIAS (id, bias) entries."""
    bias_ids, biases = logit_bias_arrays(logit_bias or {})
    return seed % (1 << 32), sample_id, temperature, top_k or 0, 1.0 if top_p is None else top_p, bias_ids, biases


_DTYPES = (np.uint32, np.int32, np.float32, np.int32, np.float32, np.int32, np.float32)


def sampling_arrays(rows: Sequence[tuple]) -> RowSampling:
    """`RowSampling` of NumPy arrays from B >= 1 `row_sampling` tuples: [B] each, the logit bias
    [B, MAX_LOGIT_BIAS]."""
    return RowSampling(*(np.array([r[f] for r in rows], dtype) for f, dtype in enumerate(_DTYPES)))


def trim_bias(sampling: RowSampling) -> RowSampling:
    """sampling with its logit bias cut to [B, 0] when no row has a (nonzero) bias: the plain program, and the
    same tokens (adding 0 changes no logit)."""
    if np.any(sampling.biases):
        return sampling
    return sampling._replace(bias_ids=sampling.bias_ids[:, :0], biases=sampling.biases[:, :0])


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """jnp.argmax(logits [B, V], -1) as int32 [B] (the first maximum; a NaN counts as the maximum) in plain
    reductions: XLA:CPU runs an argmax's index-carrying reduction element by element (0.9 ms over a 201k
    vocabulary, against 0.27 ms for these)."""
    nan = jnp.isnan(logits)
    top = jnp.max(jnp.where(nan, jnp.inf, logits), axis=-1, keepdims=True)
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, logits == top)
    V = logits.shape[-1]
    return jnp.min(jnp.where(hit, jnp.arange(V, dtype=jnp.int32), V), axis=-1)


def sample_rows(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
                top_p: jax.Array) -> jax.Array:
    """The one sampler: next tokens [B] int32 from logits [B, V], each row with its own parameters.

    keys [B] (one PRNG key per row, `row_keys`), temperature [B] float (0: argmax), top_k [B] int (<= 0: off),
    top_p [B] float (>= 1: off): a sample of softmax(logits / temperature) restricted to the top_k tokens and
    the top_p nucleus. A row's token depends only on its own logits, key and parameters (never on the other
    rows), so a row can be reproduced from its seed whatever batch it runs in."""
    greedy = greedy_tokens(logits)

    def sampled(_):
        V = logits.shape[-1]
        neg = jnp.finfo(jnp.float32).min
        temp = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)
        x = logits.astype(jnp.float32) / temp[:, None]
        sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
        k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V).astype(jnp.int32)
        kth = jnp.take_along_axis(sorted_x, (k - 1)[:, None], axis=-1)
        x = jnp.where(x < kth, neg, x)
        sorted_x = jnp.where(sorted_x < kth, neg, sorted_x)  # the top-k (ties kept), still sorted
        probs = jax.nn.softmax(sorted_x, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
        cutoff = jnp.min(jnp.where(before < top_p[:, None], sorted_x, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where((top_p[:, None] < 1.0) & (x < cutoff), neg, x)
        tok = jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys, x).astype(jnp.int32)
        return jnp.where(temperature > 0, tok, greedy)

    return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda _: greedy, None)


def row_keys(seeds: jax.Array, sample_ids: jax.Array, steps: jax.Array) -> jax.Array:
    """One PRNG key per row [B]: fold_in(fold_in(key(seed), sample_id), step)."""
    def one(seed, sid, step):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), sid), step)
    return jax.vmap(one)(seeds, sample_ids, steps)


def add_logit_bias(logits: jax.Array, bias: tuple[jax.Array, jax.Array] | None) -> jax.Array:
    """logits [B, V] plus a logit bias: None (unchanged), (ids [K], biases [K]) for every row or (ids [B, K],
    biases [B, K]) per row (unused entries: bias 0); float32 where a bias is added."""
    if bias is None or bias[0].shape[-1] == 0:
        return logits
    ids, vals = bias
    rows = jnp.arange(logits.shape[0])[:, None]
    ids = jnp.broadcast_to(ids, (logits.shape[0], ids.shape[-1]))
    vals = jnp.broadcast_to(vals, ids.shape)
    return logits.astype(jnp.float32).at[rows, ids].add(vals)


def finite_rows(logits: jax.Array) -> jax.Array:
    """[B] bool: whether each row of logits [B, V] is finite (one reduction; read back with the tokens)."""
    return jnp.isfinite(logits).all(axis=-1)


def sample_step(logits: jax.Array, steps: jax.Array, sampling: RowSampling) -> jax.Array:
    """Next tokens [B] of one step: logits [B, V] plus the rows' logit bias, sampled by `sample_rows` with the
    keys of `row_keys` at `steps` ([B], or [] for every row)."""
    steps = jnp.broadcast_to(jnp.asarray(steps, jnp.int32), logits.shape[:1])
    keys = row_keys(sampling.seeds, sampling.sample_ids, steps)
    return sample_rows(add_logit_bias(logits, (sampling.bias_ids, sampling.biases)), keys, sampling.temperature,
                       sampling.top_k, sampling.top_p)


@jax.jit  # one program: a model with per-layer programs runs the step bodies eagerly around them, where the
# sampler's lax.cond would be traced and compiled again at every step
def _next_tokens(logits: jax.Array, steps: jax.Array, sampling: RowSampling):
    """(tokens [B], finite [B], last logits [B, V]) from the model's logits [B, T, V]: its last column."""
    last = logits[:, -1]
    return sample_step(last, steps, sampling), finite_rows(last), last


def _padding(pad: jax.Array | None, B: int) -> jax.Array:
    """Each row's left padding [B] int32 (None: none)."""
    return jnp.zeros((B,), jnp.int32) if pad is None else jnp.asarray(pad, jnp.int32)


def _cache_slots(cache: Any) -> tuple[int, int]:
    """(rows B, slots L) of a KV cache whose leaves are [B, H, L, D] (`CausalLM.init_cache`)."""
    B, _, L = jax.tree.leaves(cache)[0].shape[:3]
    return B, L


def _key_valid(pad: jax.Array, L: int) -> jax.Array:
    """[B, L] bool: the slots a row's queries may see at all (its left padding masked)."""
    return jnp.arange(L)[None, :] >= pad[:, None]


@functools.partial(jax.jit, static_argnums=(2, 3))
def _decode_context(index: jax.Array, pad: jax.Array | None, rows: int, slots: int) -> AttnContext:
    """A decode step's attention context for `rows` rows over `slots` cache slots: one program (with per-layer
    programs the step body runs unjitted, and each of these few array operations would be a dispatch of its
    own at every step; inside a jitted step it is inlined)."""
    pad = _padding(pad, rows)
    positions = jnp.broadcast_to(index - pad, (rows,))[:, None].astype(jnp.int32)
    return AttnContext(positions, index, _key_valid(pad, slots))


def prefill_body(apply: Any, params: Any, ids: jax.Array, cache: Any, sampling: RowSampling,
                 pad: jax.Array | None = None, last_at: jax.Array | None = None, live: jax.Array | None = None):
    """Step 0: feeds the prompts ids [B, T] into cache slots 0 .. T-1 and samples each row's first token.

    pad [B]: left padding (see the module docstring) or None; last_at [B]: the column of each row's last
    prompt token (None: T - 1, as left-padded rows have); live [B] bool: the rows that hold a prompt (None:
    all). Padding columns and dead rows are left out of the MoE layers' experts (`AttnContext.query_valid`).
    Returns (tokens [B], finite [B], logits [B, V] at last_at, cache)."""
    TRACES["prefill"] += 1
    B, T = ids.shape
    padded = pad is not None or last_at is not None or live is not None
    pad = _padding(pad, B)
    positions = jnp.maximum(jnp.arange(T)[None, :] - pad[:, None], 0).astype(jnp.int32)
    last_at = jnp.full((B,), T - 1) if last_at is None else last_at
    real = None  # every token real: no mask (the routing keeps its fused kernel)
    if padded:
        columns = jnp.arange(T)[None, :]
        real = (columns >= pad[:, None]) & (columns <= last_at[:, None])
        if live is not None:
            real = real & live[:, None]
    # index None: the prompts start at slot 0 of an empty cache (attention reads only their T slots)
    ctx = AttnContext(positions, None, _key_valid(pad, _cache_slots(cache)[1]), real)
    logits, cache = apply(params, ids, ctx, cache, logits_at=last_at)  # [B, 1, V]
    return (*_next_tokens(logits, jnp.zeros((B,), jnp.int32), sampling), cache)


def decode_body(apply: Any, params: Any, tok: jax.Array, index: jax.Array, steps: jax.Array, cache: Any,
                sampling: RowSampling, pad: jax.Array | None = None, live: jax.Array | None = None):
    """One decode step over the cache's first R = len(tok) rows (R <= B; the rows after them are left as they
    are): feeds tok [R] at cache slot index ([] for every row, or [R]: each row's own slot) and samples the
    next tokens, token number steps ([] or [R]) of each row. pad [R]: left padding, or None (see the module
    docstring); live [R] bool: the rows that hold a request (None: all; the others skip the MoE layers'
    experts). Returns (tokens [R], finite [R], logits [R, V], cache [B, ...])."""
    TRACES["decode"] += 1
    R = tok.shape[0]
    B, L = _cache_slots(cache)
    ctx = _decode_context(index, pad, R, L)
    if live is not None:
        ctx = ctx._replace(query_valid=live[:, None])
    if R == B:
        logits, cache = apply(params, tok[:, None], ctx, cache)
    else:  # the rows past R are all free: leave them out of the step
        logits, sub = apply(params, tok[:, None], ctx, jax.tree.map(lambda c: c[:R], cache))
        cache = jax.tree.map(lambda c, s: jax.lax.dynamic_update_slice_in_dim(c, s, 0, axis=0), cache, sub)
    return (*_next_tokens(logits, steps, sampling), cache)


prefill_step = ModelStep(prefill_body)
decode_step = ModelStep(decode_body)
