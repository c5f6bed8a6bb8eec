"""Autoregressive generation with a static KV cache: a host loop over one jitted prefill and one jitted decode
step, the steps of continuous batching (`steps.prefill_step`, `steps.decode_step`), or all steps on device.

Prompts of different lengths are left-aligned internally: each row is shifted so its real tokens end at the
last prompt column (left padding); RoPE positions count real tokens only and padding slots are masked out of
every attention, so a row's result equals that prompt run alone. The cache length is static
(prompt columns + max_new_tokens, rounded up to `cache_multiple`), so the decode step compiles once.

Greedy by default; `temperature > 0` samples (seeded), optionally restricted by top_k / top_p; `logit_bias`
({token id: bias in [-100, 100]}) is added to every step's logits before either. Row b's token n uses the key
fold_in(fold_in(key(seed), b), n) (`steps.row_keys`), so `generate` and a
`continuous.Request(seed=seed, sample_id=b)` sample alike.

Sampling parameters are checked by `sampling.check_sampling` (the rules the server applies too): temperature
finite and >= 0, top_p in (0, 1], top_k >= 0, max_new_tokens >= 1 and, when the model's config gives its
context (max_position_embeddings), longest prompt + max_new_tokens within it. Every step also checks that
its logits are finite (one reduction, read back with the tokens): NaN or inf raises `NonFiniteLogitsError`
(a FloatingPointError) naming the step instead of emitting garbage tokens.

A row finishes after it emits a stop token (`stop_token_ids` / `eos_token_id`) or reaches its own
`max_new_tokens_per_row`; its later positions hold pad_token_id. The host loop ends as soon as every row has
finished (or a `stream_callback` asks it to), so finished batches run no further decode steps; the result
arrays keep their [B, max_new_tokens] shape either way.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._sampling import NonFiniteLogitsError, check_logit_bias, check_sampling, model_context
from ._steps import (add_logit_bias, decode_body, decode_step, finite_rows, prefill_body, prefill_step, row_keys,
                    row_sampling, sample_rows, sample_step, sampling_arrays, trim_bias)

# the sampler's names stay importable from here
__all__ = ["GenerationResult", "NonFiniteLogitsError", "add_logit_bias", "finite_rows", "generate", "left_align",
           "left_pad", "row_keys", "sample_rows", "sample_step"]


@dataclasses.dataclass
class GenerationResult:
    """tokens [B, max_new_tokens] int32: the new tokens (after a row finished, pad_token_id);
    sequences [B, T + max_new_tokens]: each prompt (left-padded with pad_token_id) followed by its tokens;
    prompt_lengths [B]; logits [B, max_new_tokens, V] float32 of every step when requested (NaN for the steps
    an early stop skipped); completion_lengths [B]: how many tokens each row produced (its stop token included;
    the positions after them are padding)."""

    tokens: np.ndarray
    sequences: np.ndarray
    prompt_lengths: np.ndarray
    logits: np.ndarray | None = None
    completion_lengths: np.ndarray | None = None


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int = 0, width: int | None = None,
             dtype: Any = np.int32):
    """(ids [B, T], mask [B, T] bool, lengths [B]) of prompts (token id sequences) placed at the end of T =
    `width` (default: the longest prompt) columns, the columns before them pad_token_id (left padding)."""
    lengths = np.array([len(p) for p in prompts], np.int64)
    T = int(lengths.max()) if width is None else width
    ids = np.full((len(prompts), T), pad_token_id, dtype)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):] = p
    return ids, np.arange(T)[None, :] >= (T - lengths)[:, None], lengths


def left_align(input_ids: np.ndarray, attention_mask: np.ndarray | None, pad_token_id: int = 0):
    """(ids [B, T] left-padded, mask [B, T] bool, lengths [B]) from a left- or right-padded batch.

    Each row's real tokens must be contiguous (the usual left or right padding)."""
    ids = np.asarray(input_ids)
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {ids.shape}")
    mask = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask shape {mask.shape} != input_ids shape {ids.shape}")
    if (mask.sum(1) == 0).any():
        raise ValueError("every prompt needs at least one token (a row of attention_mask is all zeros)")
    rows = []
    for b in range(ids.shape[0]):
        pos = np.flatnonzero(mask[b])
        if pos[-1] - pos[0] + 1 != len(pos):
            raise ValueError(f"row {b}: attention_mask tokens are not contiguous (use left or right padding)")
        rows.append(ids[b, pos])
    return left_pad(rows, pad_token_id, ids.shape[1], ids.dtype)


@functools.partial(jax.jit, static_argnames=("apply", "num_steps"))
def _generate_on_device(apply, params, ids, pad, cache, sampling, num_steps):
    """Prefill + lax.scan over the decode steps in one program: (tokens [B, N], finite [B, N], logits [B, N, V])."""
    T = ids.shape[1]
    tok, ok, last, cache = prefill_body(apply, params, ids, cache, sampling, pad)

    def step(carry, i):
        tok, cache = carry
        tok, ok, last, cache = decode_body(apply, params, tok, T + i - 1, i, cache, sampling, pad)
        return (tok, cache), (tok, ok, last)

    steps = jnp.arange(1, num_steps, dtype=jnp.int32)
    _, (toks, oks, lasts) = jax.lax.scan(step, (tok, cache), steps)
    return (jnp.concatenate([tok[:, None], toks.T], axis=1), jnp.concatenate([ok[:, None], oks.T], axis=1),
            jnp.concatenate([last[:, None], jnp.swapaxes(lasts, 0, 1)], axis=1))


StreamCallback = Callable[[int, np.ndarray], Any]


def _stop_ids(eos_token_id: int | None, stop_token_ids: int | Sequence[int] | None) -> np.ndarray:
    """The stop tokens [S] int32: `stop_token_ids` (an int or a sequence) plus the `eos_token_id` alias."""
    if stop_token_ids is None:
        ids = []
    elif np.ndim(stop_token_ids) == 0:
        ids = [int(stop_token_ids)]
    else:
        ids = [int(t) for t in stop_token_ids]
    if eos_token_id is not None:
        ids.append(eos_token_id)
    return np.unique(np.asarray(ids, np.int64)).astype(np.int32)


def _row_limits(per_row, B: int, max_new_tokens: int) -> np.ndarray:
    """Each row's token budget [B] int: `max_new_tokens_per_row` checked against [1, max_new_tokens]."""
    if per_row is None:
        return np.full(B, max_new_tokens, np.int64)
    limits = np.asarray(per_row, np.int64).reshape(-1)
    if limits.shape != (B,):
        raise ValueError(f"max_new_tokens_per_row needs one value per row ({B}), got shape {np.shape(per_row)}")
    if (limits < 1).any() or (limits > max_new_tokens).any():
        raise ValueError(f"max_new_tokens_per_row values must be in [1, max_new_tokens={max_new_tokens}]")
    return limits


def _mask_finished(raw: np.ndarray, stops: np.ndarray, limits: np.ndarray, pad_token_id: int):
    """(tokens [B, N], completion_lengths [B]) from the raw tokens [B, N]: positions after a row's first stop
    token or past its limit become pad_token_id."""
    N = raw.shape[1]
    hit = np.isin(raw, stops) | (np.arange(N)[None, :] + 1 >= limits[:, None])
    after = np.cumsum(hit, axis=1) - hit > 0  # strictly after the first hit
    return np.where(after, pad_token_id, raw).astype(np.int32), (~after).sum(axis=1)


def _check_finite(ok: np.ndarray, first_step: int = 0) -> None:
    """Raises NonFiniteLogitsError at the first step (column of ok [B, n], the first one being `first_step`)
    where a row's logits were not all finite."""
    bad = ~np.asarray(ok, bool).reshape(ok.shape[0], -1)
    if bad.any():
        step = int(np.flatnonzero(bad.any(axis=0))[0])
        raise NonFiniteLogitsError(first_step + step, np.flatnonzero(bad[:, step]).tolist())


def _wants_stop(ret: Any) -> bool:
    """A callback's early-stop request: only an actual True (a callback returning e.g. a list does not stop)."""
    return isinstance(ret, (bool, np.bool_)) and bool(ret)


def generate(model: Any, input_ids, max_new_tokens: int, *, attention_mask=None, pad_token_id: int = 0,
             eos_token_id: int | None = None, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int = 0, cache_multiple: int = 16,
             return_logits: bool = False, on_device: bool = False,
             stop_token_ids: int | Sequence[int] | None = None, max_new_tokens_per_row=None,
             stream_callback: StreamCallback | None = None,
             logit_bias: dict[int, float] | None = None) -> GenerationResult:
    """Generates up to max_new_tokens tokens after each prompt.

    Args:
      model: a `tutel_jax.models.CausalLM` (anything with `.params`, `.init_cache(B, L)` and a pure, hashable
        `.forward_fn(params, ids, ctx, cache, logits_at=None) -> (logits, cache)`).
      input_ids: [B, T] int prompts; attention_mask [B, T] (1 = token) for prompts of different lengths,
        left or right padded.
      eos_token_id: a stop token (an alias kept for `stop_token_ids=eos_token_id`; both may be given).
      temperature, top_k, top_p, seed: sampling (temperature 0: greedy; finite and >= 0), top_k (None or 0:
        off; else >= 1), top_p (None or 1: off; in (0, 1]); checked by `sampling.check_sampling` with
        max_new_tokens (>= 1; the longest prompt + max_new_tokens within the model's context, when its config
        gives max_position_embeddings). Bad values raise `SamplingParamError` (a ValueError).
      cache_multiple: the static cache length is rounded up to a multiple of it (fewer recompiles).
      return_logits: also return every step's logits [B, max_new_tokens, V] (NaN for steps not run).
      on_device: run prefill and all decode steps as one compiled program (lax.scan; no per-token dispatch,
        one compile per max_new_tokens) instead of a host loop over a jitted decode step. All steps run (stop
        tokens and row limits only pad the result); incompatible with `stream_callback`.
      stop_token_ids: an int or a sequence of ints; a row that emits one keeps it and is finished.
      max_new_tokens_per_row: [B] ints in [1, max_new_tokens]; a row is finished after that many tokens.
      logit_bias: {token id: bias in [-100, 100]} added to every row's logits at every step before sampling or
        argmax (`sampling.check_logit_bias`; ids within the model's vocab_size); the returned logits are the
        model's own.
      stream_callback: `fn(step, tokens)` called in the host loop right after step `step` (0: the prefill)
        with that step's tokens [B] int32 as NumPy (pad_token_id for rows finished at an earlier step), i.e.
        column `step` of the result. Returning True (a bool) stops every row after this step.

    The host loop stops early once every row has finished; the same arguments give the same tokens whether or
    not it stops early, and with or without a callback (the sampling keys depend only on seed and step).
    Logits that are not finite (NaN / inf) at some step raise `NonFiniteLogitsError` (a FloatingPointError
    naming the step and rows): the host loop raises at that step, before the callback sees its tokens; the
    other paths once their tokens are read back.
    """
    if on_device and stream_callback is not None:
        raise ValueError("stream_callback needs the host loop (one dispatch per step): use on_device=False")
    ids, _, lengths = left_align(input_ids, attention_mask, pad_token_id)
    params = check_sampling(max_new_tokens, temperature, top_k, top_p, prompt_length=int(lengths.max()),
                            context=model_context(model))
    max_new_tokens = params.max_new_tokens
    config = getattr(model, "config", None)
    vocab = config.get("vocab_size") if isinstance(config, dict) else None
    bias_map = check_logit_bias(logit_bias, vocab if isinstance(vocab, int) else None)
    B, T = ids.shape
    stops = _stop_ids(eos_token_id, stop_token_ids)
    limits = _row_limits(max_new_tokens_per_row, B, max_new_tokens)
    L = -(-(T + max_new_tokens) // cache_multiple) * cache_multiple
    pad = jnp.asarray(T - lengths, jnp.int32)
    apply = model.forward_fn
    # row b samples token n with the key fold_in(fold_in(key(seed), b), n) (`row_keys`); the logit bias has a
    # fixed width (one compile whatever the number of biased tokens)
    rows = [row_sampling(seed, b, params.temperature, params.top_k, params.top_p, bias_map) for b in range(B)]
    sampling = jax.device_put(trim_bias(sampling_arrays(rows)))
    ids_j, cache = jnp.asarray(ids, jnp.int32), model.init_cache(B, L)
    if on_device:
        tokens, ok, logits = _generate_on_device(apply, model.params, ids_j, pad, cache, sampling, max_new_tokens)
        raw, logits = np.asarray(tokens, np.int32), (np.asarray(logits) if return_logits else None)
        used = np.arange(max_new_tokens)[None, :] < _mask_finished(raw, stops, limits, pad_token_id)[1][:, None]
        _check_finite(np.asarray(ok) | ~used)  # the steps after a row finished only pad the result
    else:
        def step(tok, i, cache):  # decode step i (>= 1): feeds step i-1's tokens at cache index T + i - 1
            return decode_step(apply, model.params, tok, jnp.asarray(T + i - 1, jnp.int32),
                               jnp.asarray(i, jnp.int32), cache, sampling, pad)

        first = prefill_step(apply, model.params, ids_j, cache, sampling, pad)
        if stream_callback is None and len(stops) == 0 and max_new_tokens_per_row is None:
            raw, logits = _run_all(step, first, max_new_tokens, return_logits)
        else:
            raw, logits, steps_run = _run_until_finished(step, first, max_new_tokens, stops, limits, pad_token_id,
                                                         stream_callback, return_logits)
            limits = np.minimum(limits, steps_run)  # the columns not run are padding
    tokens, completion_lengths = _mask_finished(raw, stops, limits, pad_token_id)
    return GenerationResult(tokens=tokens, sequences=np.concatenate([ids, tokens], axis=1).astype(np.int32),
                            prompt_lengths=lengths, logits=logits, completion_lengths=completion_lengths)


def _run_all(step, first, N: int, return_logits: bool):
    """All N steps (prefill result `first` = (tokens, finite, logits, cache), then N - 1 decode steps),
    dispatched without waiting for the host: (raw tokens [B, N], logits [B, N, V] or None). The finite flags
    of all steps are read back once, with the tokens."""
    tok, ok, last, cache = first
    toks, oks, lasts = [tok], [ok], [last]
    for i in range(1, N):
        tok, ok, last, cache = step(tok, i, cache)
        toks.append(tok)
        oks.append(ok)
        lasts.append(last)
    _check_finite(np.asarray(jnp.stack(oks, axis=1)))
    logits = np.asarray(jnp.stack(lasts, axis=1)) if return_logits else None
    return np.asarray(jnp.stack(toks, axis=1), np.int32), logits


def _run_until_finished(step, first, N: int, stops: np.ndarray, limits: np.ndarray, pad_token_id: int,
                        callback: StreamCallback | None, return_logits: bool):
    """Steps until every row has finished or the callback asks to stop (each step's tokens are read back to
    the host): (raw tokens [B, N] with pad_token_id in the columns not run, logits or None, steps run).
    A step whose logits are not finite raises before its tokens are used."""
    tok, ok, last, cache = first
    B = tok.shape[0]
    raw = np.full((B, N), pad_token_id, np.int32)
    finished = np.zeros(B, bool)
    lasts = []
    for i in range(N):
        if i > 0:
            tok, ok, last, cache = step(tok, i, cache)
        raw[:, i] = np.asarray(tok)
        _check_finite((np.asarray(ok) | finished)[:, None], i)  # rows finished before: their logits are unused
        if return_logits:
            lasts.append(last)
        shown = np.where(finished, pad_token_id, raw[:, i]).astype(np.int32)
        finished |= np.isin(raw[:, i], stops) | (i + 1 >= limits)
        stop = callback is not None and _wants_stop(callback(i, shown))
        if stop or finished.all():
            break
    logits = None
    if return_logits:
        done = np.asarray(jnp.stack(lasts, axis=1))
        logits = np.full((B, N) + done.shape[2:], np.nan, done.dtype)
        logits[:, :done.shape[1]] = done
    return raw, logits, i + 1
