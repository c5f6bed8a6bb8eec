"""Continuous batching: a slot-based decode engine over one persistent KV cache.

    batcher = ContinuousBatcher(model, max_batch_size=16, max_len=512)
    req = batcher.add(Request(prompt=[5, 17, 99], max_new_tokens=32))
    while not batcher.idle:
        batcher.step()            # admits waiting requests, then one decode step over all rows
    req.tokens                    # the generated ids

The cache holds `max_batch_size` rows x `max_len` slots; each running request owns one row. A row's prompt
sits in slots 0 .. P-1 (RoPE position = slot) and its n-th fed token in slot P + n - 1, so every row has its
own cache index (`AttnContext.index` [B]) and attention masks each row causally at its own slot: what a
previous occupant left in later slots is never seen, and no row needs to be cleared.

Each `step`:
  1. admission: waiting requests take free rows (FIFO); their prompts are prefilled in groups of the same
     length bucket (a power of two >= 16, capped at max_len; groups padded to a power-of-two size) on a fresh
     [group, bucket] cache whose slots are then written into the big cache's rows; the prefill samples each
     row's first token;
  2. one jitted decode step over all `max_batch_size` rows (free rows compute garbage that is ignored)
     samples every running row's next token. With `row_buckets`, the step runs only the leading power-of-two
     rows that cover every running row (admission fills the lowest free rows first), so a lightly loaded
     engine does not pay for all rows (on CPU, or MoE layers whose idle rows would still touch experts).
Tokens are delivered as they are produced (`Request.on_token`); a request finishes at a stop token (kept, as
in `generate`), at max_new_tokens, or when on_token returns True, and its row is free for the next admission.
A request whose logits are not finite (NaN / inf; checked per row at every step with one reduction, read back
with the tokens) finishes at once with finish_reason 'error' and `error` = `NonFiniteLogitsError`, without
that step's token; its cache row is zeroed (masked NaN values would still poison the next occupant's attention)
and the other rows run on. `add` checks a request's sampling parameters with `sampling.check_sampling` (the
rules of `generate` and the server), and that prompt + max_new_tokens fits the model's context.

The prefill and decode steps are those of `generate` (`steps.prefill_body`, `steps.decode_step`: model forward,
finite check, logit bias, sampler), with each row's own cache index and no left padding. Shapes are static:
the decode step compiles once per engine shape (row_buckets: once per power of two up to max_batch_size), the
prefill once per (group size, bucket).
Greedy rows equal offline `generate` on the same prompt. Sampling is per row (temperature / top_k / top_p /
logit bias arrays): token n of a request uses fold_in(fold_in(key(seed), sample_id), n), so a seeded request
gives the same tokens whatever else runs beside it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..models import ModelStep
from ._sampling import NonFiniteLogitsError, check_logit_bias, check_sampling, model_context
from ._steps import (TRACES, RowSampling, _cache_slots, decode_step, prefill_body, row_sampling, sampling_arrays,
                     trim_bias)

__all__ = ["TRACES", "ContinuousBatcher", "Request", "prompt_bucket"]


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence to continue. prompt: token ids (>= 1); max_new_tokens >= 1; sampling: temperature (0:
    greedy), top_k (None / <= 0: off), top_p (None / >= 1: off), seed and sample_id (an extra key stream, e.g.
    the choice index of an n > 1 request); logit_bias {token id: bias in [-100, 100]} is added to its logits
    before sampling (greedy included); stop_token_ids finish the request (the stop token is kept);
    on_token(token) is called for every new token and may return True to finish the request there.
    Filled in by the engine: tokens, finished, finish_reason ('stop', 'length', 'callback' or 'error'), row,
    error (a NonFiniteLogitsError when finish_reason is 'error')."""

    prompt: Sequence[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    sample_id: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    on_token: Callable[[int], Any] | None = None
    logit_bias: dict[int, float] | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    row: int | None = None
    error: Exception | None = None


def prompt_bucket(length: int, max_len: int, minimum: int = 16) -> int:
    """Prefill columns for a prompt of `length` tokens: the next power of two (at least `minimum`), capped at
    max_len (few buckets: few prefill compiles)."""
    return min(max_len, max(minimum, 1 << (length - 1).bit_length()))


def _prefill_rows_body(apply, params, ids, lengths, rows, cache, sampling):
    """Prefills ids [G, Tb] (each row's prompt right-padded; lengths [G]) on a fresh [G, Tb] cache
    (`steps.prefill_body`: the first tokens [G] and their finite flags [G]), then writes its slots 0 .. Tb-1
    into the big cache's rows `rows` [G] (an out-of-range row: dropped, for padding groups): (tokens [G],
    finite [G], cache)."""
    G, Tb = ids.shape
    small = jax.tree.map(lambda c: jnp.zeros((G, c.shape[1], Tb) + c.shape[3:], c.dtype), cache)  # [G, H, Tb, D]
    live = rows < _cache_slots(cache)[0]  # padding entries (row B): no prompt
    toks, ok, _, small = prefill_body(apply, params, ids, small, sampling, last_at=lengths - 1, live=live)
    cache = jax.tree.map(lambda c, s: c.at[rows, :, :Tb].set(s, mode="drop"), cache, small)
    return toks, ok, cache


_prefill_rows = ModelStep(_prefill_rows_body)


@functools.partial(jax.jit, donate_argnums=(0,))
def _zero_row(cache, row):
    """The cache with row `row` zeroed (after non-finite logits: masked slots still enter attention as 0 * v)."""
    return jax.tree.map(lambda c: c.at[row].set(0), cache)


def _request_sampling(req: Request | None) -> tuple:
    """A request's `row_sampling` (None: a free row or a padding entry, greedy)."""
    if req is None:
        return row_sampling(0, 0, 0.0, None, None, None)
    return row_sampling(req.seed, req.sample_id, req.temperature, req.top_k, req.top_p, req.logit_bias)


class _Rows:
    """Host-side per-row state [B] of the running requests (free rows: zeros, greedy)."""

    def __init__(self, B: int):
        self.tok = np.zeros(B, np.int32)        # the last sampled token, fed by the next decode step
        self.index = np.zeros(B, np.int32)      # the slot that token goes to
        self.sampling = sampling_arrays([_request_sampling(None)] * B)

    def set(self, r: int, req: Request | None):
        """Row r's sampling parameters: those of req (None: a free row)."""
        for col, value in zip(self.sampling, _request_sampling(req)):
            col[r] = value

    def clear(self, r: int):
        self.tok[r] = self.index[r] = 0
        self.set(r, None)

    def sampling_of(self, R: int) -> RowSampling:
        """The sampling arrays of the first R rows (`steps.trim_bias`)."""
        return trim_bias(RowSampling(*(col[:R] for col in self.sampling)))


class ContinuousBatcher:
    """The slot engine (see the module docstring). Not thread-safe: one thread calls add / step.

    model: a CausalLM (`.params`, `.init_cache(B, L)`, pure hashable `.forward_fn`); max_batch_size rows;
    max_len slots per row (a request needs len(prompt) + max_new_tokens - 1 <= max_len, and len(prompt) +
    max_new_tokens <= the model's context when its config gives one); min_bucket: the
    smallest prefill bucket. row_buckets: decode only the leading power-of-two rows that cover every running
    row (one decode compile per power of two <= max_batch_size instead of one in all; worth it where a step's
    cost grows with its rows, e.g. on CPU, when fewer requests run than there are rows)."""

    def __init__(self, model: Any, max_batch_size: int = 16, max_len: int = 256, min_bucket: int = 16,
                 row_buckets: bool = False):
        if max_batch_size < 1 or max_len < 2:
            raise ValueError(f"need max_batch_size >= 1 and max_len >= 2, got {max_batch_size}, {max_len}")
        self.model, self.B, self.L, self.min_bucket = model, max_batch_size, max_len, min_bucket
        self.row_buckets = row_buckets
        self.cache = model.init_cache(max_batch_size, max_len)
        self.slots: list[Request | None] = [None] * max_batch_size
        self.state = _Rows(max_batch_size)
        self.waiting: collections.deque[Request] = collections.deque()
        self.decode_steps = 0
        self.last_decode_s = 0.0  # the last decode step's seconds, its tokens read back (0: none yet)
        self.prefills = 0
        self.context = model_context(model)

    # -- queue
    def add(self, req: Request) -> Request:
        """Queues a request (admitted at a next step); ValueError (a SamplingParamError for its sampling
        parameters) if they are out of range or it cannot fit a row or the model's context."""
        P = len(req.prompt)
        if P < 1:
            raise ValueError("a request needs a non-empty prompt")
        check_sampling(req.max_new_tokens, req.temperature, req.top_k, req.top_p, prompt_length=P,
                       context=self.context)
        vocab = self.model.config.get("vocab_size") if isinstance(getattr(self.model, "config", None), dict) else None
        req.logit_bias = check_logit_bias(req.logit_bias, vocab if isinstance(vocab, int) else None) or None
        if P + req.max_new_tokens - 1 > self.L:
            raise ValueError(f"prompt ({P}) + max_new_tokens ({req.max_new_tokens}) exceeds the engine's "
                             f"max_len {self.L} + 1")
        self.waiting.append(req)
        return req

    @property
    def running(self) -> list[Request]:
        return [r for r in self.slots if r is not None]

    @property
    def idle(self) -> bool:
        """Nothing waiting and nothing running."""
        return not self.waiting and all(r is None for r in self.slots)

    def reset(self) -> list[Request]:
        """Drops every running and waiting request (e.g. after a failed step) and starts a fresh cache; returns
        the dropped requests."""
        dropped = self.running + list(self.waiting)
        self.waiting.clear()
        for r in range(self.B):
            self.slots[r] = None
            self.state.clear(r)
        self.cache = self.model.init_cache(self.B, self.L)
        return dropped

    # -- stepping
    def step(self) -> list[Request]:
        """Admits waiting requests into free rows (prefill + first token), then runs one decode step over all
        rows if any is running. Returns the requests finished during this step."""
        done = self._admit()
        if any(r is not None for r in self.slots):
            done += self._decode_step()
        return done

    def run(self) -> None:
        """Steps until nothing is waiting or running; then raises the first failed request's error (the others
        are complete)."""
        failed = []
        while not self.idle:
            failed += [r for r in self.step() if r.error is not None]
        if failed:
            raise failed[0].error

    def _admit(self) -> list[Request]:
        free = [r for r in range(self.B) if self.slots[r] is None]
        admitted = []
        while free and self.waiting:
            req = self.waiting.popleft()
            req.row = free.pop(0)
            self.slots[req.row] = req
            self.state.set(req.row, req)
            admitted.append(req)
        groups: dict[int, list[Request]] = collections.defaultdict(list)
        for req in admitted:
            groups[prompt_bucket(len(req.prompt), self.L, self.min_bucket)].append(req)
        done = []
        for Tb, reqs in groups.items():
            done += self._prefill_group(Tb, reqs)
        return done

    def _prefill_group(self, Tb: int, reqs: list[Request]) -> list[Request]:
        G = 1 << (len(reqs) - 1).bit_length()  # padded group size: few compiles
        ids = np.zeros((G, Tb), np.int32)
        lengths = np.ones(G, np.int32)
        rows = np.full(G, self.B, np.int32)  # padding entries write nowhere
        for g, req in enumerate(reqs):
            ids[g, :len(req.prompt)] = req.prompt
            lengths[g], rows[g] = len(req.prompt), req.row
        sampling = trim_bias(sampling_arrays([_request_sampling(r) for r in reqs + [None] * (G - len(reqs))]))
        # NumPy arguments go to the jitted function as they are (cheaper than one device_put each); the host
        # state they may alias is only changed after the step's tokens have been read back
        toks, ok, self.cache = _prefill_rows(self.model.forward_fn, self.model.params, ids, lengths, rows,
                                             self.cache, sampling)
        self.prefills += 1
        toks, ok = np.asarray(toks), np.asarray(ok)
        return [req for g, req in enumerate(reqs) if self._deliver(req, int(toks[g]), bool(ok[g]))]

    def _decode_rows(self) -> int:
        """How many leading rows the decode step runs: all B, or (row_buckets) the power of two (capped at B)
        covering the last running row; admission fills the lowest free rows, so running rows stay in front."""
        if not self.row_buckets:
            return self.B
        last = max(r for r in range(self.B) if self.slots[r] is not None)
        return min(self.B, 1 << last.bit_length())

    def _decode_step(self) -> list[Request]:
        s, R = self.state, self._decode_rows()
        steps = np.array([len(r.tokens) if r is not None else 0 for r in self.slots[:R]], np.int32)
        live = np.array([r is not None for r in self.slots[:R]])  # free rows skip the experts
        start = time.perf_counter()
        toks, ok, _, self.cache = decode_step(self.model.forward_fn, self.model.params, s.tok[:R], s.index[:R],
                                              steps, self.cache, s.sampling_of(R), None, live)
        self.decode_steps += 1
        toks, ok = np.asarray(toks), np.asarray(ok)
        self.last_decode_s = time.perf_counter() - start
        return [req for req in list(self.slots)
                if req is not None and self._deliver(req, int(toks[req.row]), bool(ok[req.row]))]

    def _deliver(self, req: Request, token: int, finite: bool = True) -> bool:
        """Gives the request its next token; frees its row (True) if it is finished. Non-finite logits (the
        token is garbage) fail the request instead."""
        if not finite:
            req.error = NonFiniteLogitsError(len(req.tokens))
            req.finish_reason, req.finished = "error", True
            self.cache = _zero_row(self.cache, req.row)
            self.slots[req.row] = None
            self.state.clear(req.row)
            return True
        req.tokens.append(token)
        stop = req.on_token is not None and req.on_token(token) is True
        if token in req.stop_token_ids:
            req.finish_reason = "stop"
        elif len(req.tokens) >= req.max_new_tokens:
            req.finish_reason = "length"
        elif stop:
            req.finish_reason = "callback"
        else:  # feed it next step: its slot follows the prompt and the tokens fed so far
            self.state.tok[req.row] = token
            self.state.index[req.row] = len(req.prompt) + len(req.tokens) - 1
            return False
        req.finished = True
        self.slots[req.row] = None
        self.state.clear(req.row)
        return True
