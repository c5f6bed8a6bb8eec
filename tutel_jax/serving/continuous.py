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

Shapes are static: the decode step compiles once per engine shape (row_buckets: once per power of two up to
max_batch_size), the prefill once per (group size, bucket).
Greedy rows equal offline `generate` on the same prompt. Sampling is per row (temperature / top_k / top_p /
logit bias arrays): token n of a request uses fold_in(fold_in(key(seed), sample_id), n), so a seeded request gives the
same tokens whatever else runs beside it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..models.layer_programs import ModelStep
from ..models.layers import AttnContext
from .generate import finite_rows, sample_step
from .sampling import (MAX_LOGIT_BIAS, NonFiniteLogitsError, check_logit_bias, check_sampling, logit_bias_arrays,
                       model_context)

__all__ = ["TRACES", "ContinuousBatcher", "Request", "prompt_bucket"]

# how many times each jitted body was traced (= compiled): "decode", "prefill" (a model with per-layer programs
# runs the bodies unjitted: every run counts)
TRACES: collections.Counter = collections.Counter()


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


def _sample(logits: jax.Array, sampling: tuple) -> jax.Array:
    """Next tokens [B] from logits [B, V] (`generate.sample_step`); sampling = (seeds, sample_ids, steps,
    temperature, top_k, top_p, bias_ids, biases): each [B], the logit bias [B, K] (K = 0 when no row has one:
    the plain program)."""
    seeds, sample_ids, steps, temperature, top_k, top_p, bias_ids, biases = sampling
    return sample_step(logits, steps, (seeds, sample_ids, temperature, top_k, top_p), (bias_ids, biases))


def _prefill_body(apply, params, ids, lengths, rows, cache, sampling):
    """Prefills ids [G, Tb] (each row's prompt right-padded; lengths [G]) on a fresh [G, Tb] cache, writes its
    slots 0 .. Tb-1 into the big cache's rows `rows` [G] (an out-of-range row: dropped, for padding groups) and
    samples each row's first token: (tokens [G], finite [G], cache)."""
    TRACES["prefill"] += 1
    G, Tb = ids.shape
    small = jax.tree.map(lambda c: jnp.zeros((G, c.shape[1], Tb) + c.shape[3:], c.dtype), cache)  # [G, H, Tb, D]
    positions = jnp.broadcast_to(jnp.arange(Tb, dtype=jnp.int32), (G, Tb))
    # right padding: a real token never sees the padding after it (causal), so every slot may be "valid"
    ctx = AttnContext(positions, jnp.zeros((), jnp.int32), jnp.ones((G, Tb), bool))
    logits, small = apply(params, ids, ctx, small, logits_at=lengths - 1)
    last = logits[:, 0]  # [G, V]: each row's last prompt token
    cache = jax.tree.map(lambda c, s: c.at[rows, :, :Tb].set(s, mode="drop"), cache, small)
    return _sample(last, sampling), finite_rows(last), cache


def _decode_body(apply, params, tok, index, cache, sampling):
    """One decode step over the cache's first R rows (R = len(tok) <= B): feeds tok [R] at each row's own slot
    index [R] (= its RoPE position) and samples the next tokens: (tokens [R], finite [R], cache [B, ...])."""
    TRACES["decode"] += 1
    R, (B, _, L) = tok.shape[0], jax.tree.leaves(cache)[0].shape[:3]  # cache leaves [B, H, L, D]
    ctx = AttnContext(index[:, None], index, jnp.ones((R, L), bool))
    if R == B:
        logits, cache = apply(params, tok[:, None], ctx, cache)
    else:  # the rows past R are all free: leave them out of the step
        logits, sub = apply(params, tok[:, None], ctx, jax.tree.map(lambda c: c[:R], cache))
        cache = jax.tree.map(lambda c, s: jax.lax.dynamic_update_slice_in_dim(c, s, 0, axis=0), cache, sub)
    last = logits[:, -1]
    return _sample(last, sampling), finite_rows(last), cache


_prefill = ModelStep(_prefill_body)
_decode = ModelStep(_decode_body)


@functools.partial(jax.jit, donate_argnums=(0,))
def _zero_row(cache, row):
    """The cache with row `row` zeroed (after non-finite logits: masked slots still enter attention as 0 * v)."""
    return jax.tree.map(lambda c: c.at[row].set(0), cache)


class _Rows:
    """Host-side per-row state [B] of the running requests (free rows: zeros, greedy)."""

    def __init__(self, B: int):
        self.tok = np.zeros(B, np.int32)        # the last sampled token, fed by the next decode step
        self.index = np.zeros(B, np.int32)      # the slot that token goes to
        self.seed = np.zeros(B, np.uint32)
        self.sample_id = np.zeros(B, np.int32)
        self.temperature = np.zeros(B, np.float32)
        self.top_k = np.zeros(B, np.int32)
        self.top_p = np.ones(B, np.float32)
        self.bias_ids = np.zeros((B, MAX_LOGIT_BIAS), np.int32)  # logit bias (unused entries: bias 0)
        self.biases = np.zeros((B, MAX_LOGIT_BIAS), np.float32)
        self.biased = np.zeros(B, bool)

    def set(self, r: int, req: Request):
        self.seed[r] = req.seed % (1 << 32)
        self.sample_id[r] = req.sample_id
        self.temperature[r] = req.temperature
        self.top_k[r] = req.top_k or 0
        self.top_p[r] = 1.0 if req.top_p is None else req.top_p
        self.biased[r] = bool(req.logit_bias)
        self.bias_ids[r], self.biases[r] = logit_bias_arrays(req.logit_bias or {})

    def clear(self, r: int):
        self.tok[r] = self.index[r] = self.seed[r] = self.sample_id[r] = self.top_k[r] = 0
        self.temperature[r], self.top_p[r] = 0.0, 1.0
        self.bias_ids[r], self.biases[r], self.biased[r] = 0, 0.0, False

    def bias(self, R: int) -> tuple[np.ndarray, np.ndarray]:
        """The logit bias of the first R rows: [R, MAX_LOGIT_BIAS], or [R, 0] when none of them has one."""
        if self.biased[:R].any():
            return self.bias_ids[:R], self.biases[:R]
        return np.zeros((R, 0), np.int32), np.zeros((R, 0), np.float32)


def _sampling_of(reqs: Sequence[Request | None]) -> tuple:
    """Sampling arrays [G] of requests (None: a padding entry, greedy), each at its next token's step."""
    def col(f, dtype):
        return np.array([0 if r is None else f(r) for r in reqs], dtype)
    width = MAX_LOGIT_BIAS if any(r is not None and r.logit_bias for r in reqs) else 0
    bias = [logit_bias_arrays((r.logit_bias or {}) if r is not None else {}, width) for r in reqs]
    return (col(lambda r: r.seed % (1 << 32), np.uint32), col(lambda r: r.sample_id, np.int32),
            col(lambda r: len(r.tokens), np.int32), col(lambda r: r.temperature, np.float32),
            col(lambda r: r.top_k or 0, np.int32),
            np.array([1.0 if r is None or r.top_p is None else r.top_p for r in reqs], np.float32),
            np.stack([b[0] for b in bias]).reshape(len(reqs), width),
            np.stack([b[1] for b in bias]).reshape(len(reqs), width))


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
        padded = list(reqs) + [None] * (G - len(reqs))
        # NumPy arguments go to the jitted function as they are (cheaper than one device_put each); the host
        # state they may alias is only changed after the step's tokens have been read back
        toks, ok, self.cache = _prefill(self.model.forward_fn, self.model.params, ids, lengths, rows, self.cache,
                                        _sampling_of(padded))
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
        sampling = (s.seed[:R], s.sample_id[:R], steps, s.temperature[:R], s.top_k[:R], s.top_p[:R], *s.bias(R))
        toks, ok, self.cache = _decode(self.model.forward_fn, self.model.params, s.tok[:R], s.index[:R],
                                       self.cache, sampling)
        self.decode_steps += 1
        toks, ok = np.asarray(toks), np.asarray(ok)
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
