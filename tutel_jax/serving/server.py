"""OpenAI-compatible HTTP server for a tutel-jax CausalLM (FastAPI + uvicorn), with dynamic batching.

    tutel-jax serve CHECKPOINT --host 127.0.0.1 --port 8000
    python -m tutel_jax.serving.server CHECKPOINT --host 127.0.0.1 --port 8000     (the same)

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions.
Prompts are token-id lists (or lists of them); text prompts need a tokenizer.json next to the checkpoint and the
`tokenizers` package; chat needs a tokenizer plus a chat template (tokenizer_config.json) and `jinja2`.
Choices always carry the generated ids as the extra field `token_ids` (`text` is "" without a tokenizer).

Requests are queued for a background worker thread. Continuous batching (--batching continuous, the default;
`continuous.ContinuousBatcher`): each request's rows (prompt x n) take free rows of one persistent KV cache
(--max-batch-size rows x --max-len slots) at the next decode step, are prefilled, and then advance with every
decode step over all rows; a row leaves at a stop token, a stop string or its max_tokens and its cache row is
reused, so a request arriving while others run starts at once and is answered when its own rows are done.
Sampled rows draw from their own seed (a random one when the request has none), whatever else is running.
Bucketed batching (--batching bucketed): the worker gathers up to --max-batch-size rows within --batch-wait-ms,
groups compatible ones (greedy with greedy; sampled ones by temperature/top_p; a seeded sampled request runs
alone so its result depends only on its seed), pads the batch (rows to a power of two, prompt columns to a
multiple of 16: fewer recompiles) and runs one `generate` call, following every row token by token; a request
is answered as soon as all its rows are done, and requests arriving meanwhile wait for the next batch.
`stream: true` sends each token as its own server-sent event as soon as it is produced (text deltas decode the
whole sequence so far, so multi-byte characters split over tokens come out whole; text that may still turn into
a stop string is held back until it is decided).

Sampling parameters follow the rules of `generate` (`sampling.check_sampling`; a bad value is a 400 naming it),
with the OpenAI caps on top: temperature in [0, 2] (default 1), max_tokens at most --max-tokens, and top_p 0
accepted as greedy. A generation that meets NaN / inf logits fails with a 500 (code 'non_finite_logits'; the
continuous engine fails only the request concerned) and the server keeps serving.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .sampling import NonFiniteLogitsError, SamplingParamError, check_sampling, model_context
from .tokenizer import IncrementalDecoder, encode, eos_token_ids, load_tokenizer

try:  # the `serve` extra; only the app needs it (annotations below are resolved in this module's globals)
    from fastapi import Request
except ImportError:  # pragma: no cover
    Request = Any

log = logging.getLogger("tutel_jax.serving.server")

__all__ = ["Engine", "ServerConfig", "create_app", "main"]


# ----------------------------------------------------------------------------------------------------- errors

class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


def _generation_error(e: Exception) -> APIError:
    """The 500 a client gets for a failed generation (NaN / inf logits get their own code)."""
    code = "non_finite_logits" if isinstance(e, NonFiniteLogitsError) else "internal_error"
    return APIError(500, f"generation failed: {e}", code=code, type="server_error")


MAX_TEMPERATURE = 2.0  # the OpenAI API's cap


# ----------------------------------------------------------------------------------------------------- config

@dataclasses.dataclass
class ServerConfig:
    max_batch_size: int = 16        # rows (prompts x n) per generate call / continuous cache rows
    batch_wait_ms: float = 5.0      # bucketed: how long the worker gathers requests after the first one
    batching: str = "continuous"    # or "bucketed"
    max_len: int | None = None      # continuous: cache slots per row (default: the context, at most 2048);
                                    # it also caps prompt + max_tokens
    row_buckets: bool = True        # continuous: a decode step runs only the leading power-of-two rows that
                                    # hold running requests (one compile per power of two)
    max_queue: int = 256            # requests waiting or running; beyond: 429
    max_tokens_limit: int = 512     # upper bound on a request's max_tokens
    max_n: int = 16
    default_max_tokens: int = 16
    model_name: str | None = None
    warmup_batch_sizes: list[int] | None = None    # compiled at startup (rows); default [1]
    warmup_prompt_lens: list[int] | None = None    # with these prompt lengths; default [1]
    warmup_max_tokens: int = 2
    dropless_impl: str = "auto"     # the MoE layers' dropless implementation when the app loads the model


def _context_length(config: dict) -> int:
    return model_context(config) or 2048


# ----------------------------------------------------------------------------------------------------- tokenizer

class TextCodec:
    """Optional tokenizer.json (+ chat template) support; everything is loaded lazily."""

    def __init__(self, path: Path):
        self.path = path
        self._tok = None
        self._loaded = False
        self._template = None

    @property
    def tokenizer(self):
        if not self._loaded:
            self._loaded = True
            try:
                self._tok = load_tokenizer(self.path)
            except FileNotFoundError:
                pass  # token-id prompts only
            except Exception as e:  # noqa: BLE001 - missing package or unreadable file
                log.warning("tokenizer.json not usable (%s); token-id prompts only", e)
        return self._tok

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise _bad("this model has no tokenizer (no tokenizer.json or the `tokenizers` package is missing): "
                       "send the prompt as a list of token ids", "prompt", "tokenizer_unavailable")
        return encode(self.tokenizer, text)

    def decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(list(ids))

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        if self.tokenizer is None:
            raise _bad("chat completions need a tokenizer (tokenizer.json) and a chat template; this model has "
                       "none: use /v1/completions with token-id prompts", "messages", "tokenizer_unavailable")
        if self._template is None:
            cfg = self.path / "tokenizer_config.json"
            tmpl = None
            if cfg.is_file():
                tmpl = json.loads(cfg.read_text()).get("chat_template")
            if not tmpl and (self.path / "chat_template.jinja").is_file():
                tmpl = (self.path / "chat_template.jinja").read_text()
            if not isinstance(tmpl, str) or not tmpl:
                raise _bad("this model has no chat template: use /v1/completions", "messages",
                           "chat_template_unavailable")
            try:
                import jinja2
            except ImportError:
                raise _bad("chat templates need the `jinja2` package", "messages", "chat_template_unavailable")
            self._template = jinja2.Environment().from_string(tmpl)
        text = self._template.render(messages=messages, add_generation_prompt=True, bos_token="", eos_token="")
        return self.encode(text)


# ----------------------------------------------------------------------------------------------------- engine

Completion = tuple[list[int], str, str]  # (token ids, text, finish_reason) of one choice after stop handling


@dataclasses.dataclass
class Job:
    """One request: its prompts (each repeated n times: one row per choice) and how its rows stop. The future
    resolves to one Completion per row as soon as all its rows are done. Streaming requests also get
    `on_event` calls from the worker thread: ("token", row, token_id, text_delta) for each token kept and
    ("finish", row, text_rest, finish_reason) when a row is done, all before the future resolves."""
    prompts: list[list[int]]
    n: int
    max_tokens: int
    temperature: float
    top_p: float | None
    seed: int | None
    future: concurrent.futures.Future
    rows: int = 0
    stop_ids: frozenset[int] = frozenset()
    stop_strs: tuple[str, ...] = ()
    on_event: Callable[[tuple], None] | None = None
    cancelled: bool = False         # the client went away: its rows are finished at the next step

    def bucket(self):
        if self.temperature == 0.0:
            return ("greedy",)
        if self.seed is not None:
            return ("seeded", id(self))
        return ("sample", self.temperature, self.top_p)

    def emit(self, event: tuple):
        if self.on_event is None or self.cancelled:
            return
        try:
            self.on_event(event)
        except RuntimeError:  # the request's event loop is closed: nobody is listening any more
            self.cancelled = True


def finish_completion(toks: list[int], stop_ids, stop_strs, codec: TextCodec | None) -> Completion:
    """(ids, text, finish_reason) of generated ids: cut before the first stop token, then at the first stop
    string (keeping the ids whose text stays within the cut)."""
    decode = codec.decode if codec is not None else (lambda ids: "")
    reason = "length"
    for i, t in enumerate(toks):
        if t in stop_ids:
            toks, reason = toks[:i], "stop"
            break
    text = decode(toks)
    for s in stop_strs:
        k = text.find(s)
        if k >= 0:
            text, reason = text[:k], "stop"
            while toks and len(decode(toks)) > len(text):
                toks = toks[:-1]
    return toks, text, reason


class _Row:
    """One choice of a job while its batch runs: the ids so far and, once done, its Completion."""

    def __init__(self, job: Job, index: int, codec: TextCodec | None):
        self.job, self.index, self.codec = job, index, codec
        self.ids: list[int] = []
        self.result: Completion | None = None
        self.req = None  # the continuous engine's slot request of this row
        tok = codec.tokenizer if codec is not None else None
        # decoding each step costs time: only for text deltas and stop strings
        wants_text = tok is not None and (job.on_event is not None or job.stop_strs)
        self.decoder = IncrementalDecoder(tok, job.stop_strs) if wants_text else None

    def push(self, token: int):
        """Adds the row's next token; the row is done after a stop token (not kept), a stop string or
        max_tokens tokens."""
        self.ids.append(token)
        if token in self.job.stop_ids:
            return self.finish()
        delta = self.decoder.push(token) if self.decoder is not None else ""
        self.job.emit(("token", self.index, token, delta))
        text = self.decoder.text if self.decoder is not None else ""
        if len(self.ids) >= self.job.max_tokens or any(s in text for s in self.job.stop_strs):
            self.finish()

    def finish(self):
        self.result = finish_completion(self.ids, self.job.stop_ids, self.job.stop_strs, self.codec)
        rest = self.decoder.rest(self.result[1]) if self.decoder is not None else ""
        self.job.emit(("finish", self.index, rest, self.result[2]))


class QueueFull(Exception):
    pass


class _Worker:
    """The job queue and background worker thread shared by both batching engines: `submit` queues a Job (or
    raises QueueFull beyond cfg.max_queue jobs waiting or running, APIError 503 once stopping); `stop` lets the
    worker finish what is queued and running, then joins it. Subclasses implement `_loop` and `warmup`."""

    def __init__(self, model, cfg: ServerConfig, pad_token_id: int = 0, codec: TextCodec | None = None):
        self.model, self.cfg, self.pad, self.codec = model, cfg, pad_token_id, codec
        self._cv = threading.Condition()
        self._pending: list[Job] = []
        self._inflight = 0
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="tutel-serve-worker", daemon=True)
        self.batches_run = 0

    def start(self):
        self._thread.start()

    def submit(self, job: Job):
        job.rows = len(job.prompts) * job.n
        with self._cv:
            if self._stop:
                raise APIError(503, "server is shutting down", code="shutting_down", type="server_error")
            if self._inflight >= self.cfg.max_queue:
                raise QueueFull()
            self._inflight += 1
            self._pending.append(job)
            self._cv.notify()

    def stop(self, timeout: float = 30.0):
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        else:  # never started: fail what is queued
            self._fail_pending()
        log.info("batching worker stopped")

    def _fail_pending(self):
        with self._cv:
            for job in self._pending:
                if not job.future.done():
                    job.future.set_exception(APIError(503, "server is shutting down", code="shutting_down",
                                                      type="server_error"))
            self._pending = []

    def _loop(self):
        raise NotImplementedError

    def warmup(self, job: Job) -> list[Completion]:
        """Runs a job to compile its shapes (called before the server answers; blocks)."""
        raise NotImplementedError

    def stats(self) -> dict:
        return {"batches_run": self.batches_run}


class Engine(_Worker):
    """Bucketed dynamic batching: the worker gathers compatible Jobs, runs one `generate` per batch and resolves
    each job's future as soon as its rows are done (`codec` decodes text: stop strings and streamed deltas).
    Jobs arriving while a batch runs wait for the next one. batches_run counts `generate` calls."""

    def warmup(self, job: Job) -> list[Completion]:
        return self.run_batch([job])[0]

    def _take_batch(self) -> list[Job] | None:
        with self._cv:
            while not self._pending and not self._stop:
                self._cv.wait()
            if not self._pending:
                return None
            deadline = time.monotonic() + self.cfg.batch_wait_ms / 1000.0
            while not self._stop:  # gather more rows for a short while
                if sum(j.rows for j in self._pending) >= self.cfg.max_batch_size:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            key = self._pending[0].bucket()
            batch, rows, rest = [], 0, []
            for j in self._pending:
                if j.bucket() == key and (not batch or rows + j.rows <= self.cfg.max_batch_size):
                    batch.append(j)
                    rows += j.rows
                else:
                    rest.append(j)
            self._pending = rest
            return batch

    def _loop(self):
        while True:
            batch = self._take_batch()
            if batch is None:
                break
            try:
                self.run_batch(batch)
            except Exception as e:  # report to the clients, keep serving
                log.exception("batch failed")
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(_generation_error(e))
            finally:
                with self._cv:
                    self._inflight -= len(batch)
                self.batches_run += 1
        self._fail_pending()  # shutting down: fail what is left

    def run_batch(self, batch: list[Job]) -> list[list[Completion]]:
        """Runs the jobs as one batch; per job, per (prompt, n) row: its Completion. Each job's future is
        resolved when its last row is done, and generation stops once every row is."""
        from .generate import generate
        rows = [_Row(j, k, self.codec) for j in batch for k in range(len(j.prompts) * j.n)]
        prompts = [p for j in batch for p in j.prompts for _ in range(j.n)]
        B = 1 << (len(prompts) - 1).bit_length()  # pad rows to a power of two
        B = max(B, len(prompts))
        T = -(-max(len(p) for p in prompts) // 16) * 16
        ids = np.full((B, T), self.pad, np.int32)
        mask = np.zeros((B, T), np.int32)
        for b, p in enumerate(prompts):
            ids[b, T - len(p):] = p
            mask[b, T - len(p):] = 1
        mask[len(prompts):, -1] = 1  # dummy rows: one pad token
        N = max(j.max_tokens for j in batch)
        j0 = batch[0]
        seed = j0.seed if j0.seed is not None else int.from_bytes(os.urandom(4), "little")
        resolved: set[int] = set()

        def on_step(step: int, toks: np.ndarray) -> bool:
            for row, t in zip(rows, toks.tolist()):
                if row.result is None and row.job.cancelled:
                    row.finish()
                elif row.result is None:
                    row.push(t)
            self._resolve(batch, rows, resolved)
            return all(row.result is not None for row in rows)  # True: stop the batch

        generate(self.model, ids, N, attention_mask=mask, pad_token_id=self.pad, temperature=float(j0.temperature),
                 top_p=j0.top_p, seed=seed, stream_callback=on_step)
        for row in rows:  # cannot happen (N covers every max_tokens), but never leave a request hanging
            if row.result is None:
                row.finish()
        self._resolve(batch, rows, resolved)
        return [[row.result for row in rows if row.job is j] for j in batch]

    @staticmethod
    def _resolve(batch: list[Job], rows: list[_Row], resolved: set[int]):
        """Resolves the future of every job (not resolved yet) whose rows are all done."""
        for k, job in enumerate(batch):
            if k in resolved:
                continue
            mine = [row for row in rows if row.job is job]
            if all(row.result is not None for row in mine):
                resolved.add(k)
                if not job.future.done():
                    job.future.set_result([row.result for row in mine])


class ContinuousEngine(_Worker):
    """Continuous batching (`continuous.ContinuousBatcher`): every job's rows (prompt x n) become slot requests
    admitted into free cache rows at the next decode step, so a request arriving while others run starts at
    once and each one is answered when its own rows are done. Greedy rows equal offline `generate`; a sampled
    row's token t uses fold_in(fold_in(key(seed), row index in its job), t), so seeded results do not depend
    on other traffic (unseeded jobs draw a random seed). batches_run counts busy periods (from an admission
    into an idle engine until it is idle again); decode_steps the decode steps run. cfg.row_buckets: decode
    steps run only the leading power-of-two rows holding running requests (see ContinuousBatcher)."""

    def __init__(self, model, cfg: ServerConfig, pad_token_id: int = 0, codec: TextCodec | None = None,
                 max_len: int = 256):
        super().__init__(model, cfg, pad_token_id, codec)
        self.max_len = max_len
        self.batcher = None
        self._jobs: dict[int, tuple[Job, list[_Row]]] = {}  # running jobs by id(job)

    def start(self):
        from .continuous import ContinuousBatcher
        self.batcher = ContinuousBatcher(self.model, self.cfg.max_batch_size, self.max_len,
                                         row_buckets=self.cfg.row_buckets)
        super().start()

    def warmup(self, job: Job) -> list[Completion]:
        self.submit(job)
        return job.future.result()

    def stats(self) -> dict:
        return {"batches_run": self.batches_run,
                "decode_steps": 0 if self.batcher is None else self.batcher.decode_steps}

    def _loop(self):
        b = self.batcher
        while True:
            with self._cv:
                while not self._pending and b.idle and not self._stop:
                    self._cv.wait()
                if not self._pending and b.idle:  # stopping, and everything is answered
                    break
                jobs, self._pending = self._pending, []
            if jobs and b.idle:
                self.batches_run += 1
            for job in jobs:
                self._admit(job)
            try:
                done = b.step()
            except Exception as e:  # report to the running clients, keep serving with a fresh cache
                log.exception("decode step failed")
                b.reset()
                self._fail_running(_generation_error(e))
            else:
                for req in done:
                    if req.error is not None:  # non-finite logits: that request fails, the others run on
                        self._fail_request(req)
            self._resolve()
        self._fail_pending()

    def _admit(self, job: Job):
        """Queues the job's rows in the batcher (one Request per prompt x choice)."""
        from .continuous import Request
        seed = job.seed if job.seed is not None else int.from_bytes(os.urandom(4), "little")
        rows, reqs = [], []
        for k, prompt in enumerate(p for p in job.prompts for _ in range(job.n)):
            row = _Row(job, k, self.codec)
            rows.append(row)
            row.req = Request(prompt=list(prompt), max_new_tokens=job.max_tokens, temperature=job.temperature,
                              top_p=job.top_p, seed=seed, sample_id=k, on_token=functools.partial(_on_token, row))
            reqs.append(row.req)
        self._jobs[id(job)] = (job, rows)
        try:
            for req in reqs:
                self.batcher.add(req)
        except ValueError as e:  # cannot happen after the server's checks; never leave the request hanging
            self.batcher.waiting = collections.deque(r for r in self.batcher.waiting if r not in reqs)
            del self._jobs[id(job)]
            self._finish_job(job, exc=_bad(str(e), "max_tokens", getattr(e, "code", "context_length_exceeded")))

    def _fail_request(self, req):
        """Fails the job of a slot request that finished with an error; the job's other rows finish (unused)
        at their next token, its rows still waiting are dropped."""
        for key, (job, rows) in list(self._jobs.items()):
            if any(row.req is req for row in rows):
                log.error("generation failed: %s", req.error)
                del self._jobs[key]
                job.cancelled = True
                mine = {id(row.req) for row in rows}
                self.batcher.waiting = collections.deque(r for r in self.batcher.waiting if id(r) not in mine)
                self._finish_job(job, exc=_generation_error(req.error))
                return

    def _resolve(self):
        """Resolves the future of every running job whose rows are all done."""
        for key, (job, rows) in list(self._jobs.items()):
            if all(row.result is not None for row in rows):
                del self._jobs[key]
                self._finish_job(job, result=[row.result for row in rows])

    def _fail_running(self, exc: APIError):
        for job, _ in self._jobs.values():
            self._finish_job(job, exc=exc)
        self._jobs = {}

    def _finish_job(self, job: Job, result=None, exc: Exception | None = None):
        if not job.future.done():
            if exc is not None:
                job.future.set_exception(exc)
            else:
                job.future.set_result(result)
        with self._cv:
            self._inflight -= 1


def _on_token(row: _Row, token: int) -> bool:
    """A slot request's token callback: feeds the server row; True (free the slot) once the row is done or its
    client went away."""
    if row.result is None:
        if row.job.cancelled:
            row.finish()
        else:
            row.push(token)
    return row.result is not None


# ----------------------------------------------------------------------------------------------------- validation

def _int(body: dict, name: str, default, lo: int, hi: int) -> int:
    v = body.get(name, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"'{name}' must be an integer, got {type(v).__name__}", name, "invalid_type")
    if not lo <= v <= hi:
        raise _bad(f"'{name}' must be between {lo} and {hi}, got {v}", name)
    return v


def _put_quietly(put: Callable[[tuple], None], event: tuple):
    try:
        put(event)
    except RuntimeError:  # the request's event loop is closed
        pass


def _is_ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


class Server:
    def __init__(self, model, path: Path, cfg: ServerConfig):
        self.model, self.path, self.cfg = model, path, cfg
        self.context = _context_length(model.config)
        v = model.config.get("vocab_size")
        self.vocab = v if isinstance(v, int) else None
        self.eos = eos_token_ids(path, model.config)
        pad = model.config.get("pad_token_id")
        pad = pad if isinstance(pad, int) else 0
        self.codec = TextCodec(path)
        if cfg.batching == "continuous":
            self.context = min(self.context, cfg.max_len or 2048)  # a request must fit one cache row
            self.engine = ContinuousEngine(model, cfg, pad, self.codec, max_len=self.context)
        elif cfg.batching == "bucketed":
            self.engine = Engine(model, cfg, pad, self.codec)
        else:
            raise ValueError(f"batching must be 'continuous' or 'bucketed', got {cfg.batching!r}")
        self.name = cfg.model_name or path.name
        self.created = int(time.time())

    # -- request parsing
    def _prompt_ids(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [self.codec.encode(prompt)]
        elif _is_ids(prompt) and prompt:
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = [self.codec.encode(p) for p in prompt]
        elif isinstance(prompt, list) and prompt and all(_is_ids(p) for p in prompt):
            prompts = [list(p) for p in prompt]
        elif prompt is None:
            raise _bad("'prompt' is required", "prompt", "missing_required_parameter")
        else:
            raise _bad("'prompt' must be a string, a list of strings, a list of token ids or a list of such lists "
                       "(and not empty)", "prompt", "invalid_type")
        for p in prompts:
            self._check_ids(p, "prompt")
        return prompts

    def _check_ids(self, p: list[int], param: str):
        if not p:
            raise _bad("prompts must not be empty", param)
        if self.vocab is not None and any(t < 0 or t >= self.vocab for t in p):
            raise _bad(f"token ids must be in [0, {self.vocab})", param)
        if len(p) >= self.context:
            raise _bad(f"prompt has {len(p)} tokens; this model's context is {self.context} tokens", param,
                       "context_length_exceeded")

    def _common(self, body: dict, prompts: list[list[int]], default_max: int) -> tuple[Job, dict]:
        longest = max(len(p) for p in prompts)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = min(default_max, self.context - longest, self.cfg.max_tokens_limit)
        temperature = body.get("temperature")
        temperature = 1.0 if temperature is None else temperature
        top_p = body.get("top_p")
        # OpenAI accepts top_p 0 (only the most likely token): greedy
        top_p_greedy = isinstance(top_p, (int, float)) and not isinstance(top_p, bool) and top_p == 0
        try:  # the rules of `generate`, with the OpenAI caps
            params = check_sampling(max_tokens, temperature, None, None if top_p_greedy else top_p,
                                    prompt_length=longest, context=self.context, max_temperature=MAX_TEMPERATURE,
                                    max_new_tokens_limit=self.cfg.max_tokens_limit,
                                    names={"max_new_tokens": "max_tokens"})
        except SamplingParamError as e:
            raise _bad(str(e), e.param, e.code) from None
        max_tokens, top_p = params.max_new_tokens, params.top_p
        temperature = 0.0 if top_p_greedy else params.temperature
        n = _int(body, "n", 1, 1, self.cfg.max_n)
        if len(prompts) * n > self.cfg.max_batch_size:
            raise _bad(f"len(prompt) * n = {len(prompts) * n} exceeds the server's max batch size "
                       f"{self.cfg.max_batch_size}", "n")
        seed = body.get("seed")
        if seed is not None:
            seed = _int(body, "seed", None, -(2 ** 63), 2 ** 63 - 1) % (2 ** 32)
        stream = body.get("stream", False)
        if not isinstance(stream, bool) and stream is not None:
            raise _bad("'stream' must be a boolean", "stream", "invalid_type")
        if body.get("logprobs") not in (None, False) or body.get("echo") or (body.get("best_of") or 1) != 1:
            raise _bad("logprobs, echo and best_of are not supported by this server", "logprobs", "unsupported")
        stop_ids, stop_strs = set(self.eos), []
        stop = body.get("stop")
        if stop is not None:
            items = stop if isinstance(stop, list) else [stop]
            if len(items) > 16:
                raise _bad("at most 16 stop sequences", "stop")
            for s in items:
                if isinstance(s, int) and not isinstance(s, bool):
                    stop_ids.add(s)
                elif isinstance(s, str) and s:
                    if self.codec.tokenizer is None:
                        raise _bad("string stop sequences need a tokenizer; this model has none: give stop token "
                                   "ids (integers)", "stop", "tokenizer_unavailable")
                    stop_strs.append(s)
                else:
                    raise _bad("'stop' must be a string, a token id, or a list of them", "stop", "invalid_type")
        for ids in body.get("stop_token_ids") or []:
            if isinstance(ids, int):
                stop_ids.add(ids)
        job = Job(prompts=prompts, n=n, max_tokens=max_tokens, temperature=temperature,
                  top_p=None if top_p is None or top_p >= 1.0 else top_p, seed=seed, future=concurrent.futures.Future(),
                  stop_ids=frozenset(stop_ids), stop_strs=tuple(stop_strs))
        return job, {"stream": bool(stream)}

    def submit(self, job: Job):
        """Queues the job (429 when the queue is full)."""
        try:
            self.engine.submit(job)
        except QueueFull:
            raise APIError(429, "the server's request queue is full; retry later", code="queue_full",
                           type="rate_limit_error")

    async def run(self, job: Job) -> list[Completion]:
        """The job's completions (one per row) once all its rows are done."""
        self.submit(job)
        return await asyncio.wrap_future(job.future)

    def stream(self, job: Job) -> asyncio.Queue:
        """Queues a streaming job; its events arrive in the returned queue (filled from the worker thread), then
        ("end", future) once the job is resolved or failed."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()

        def put(event: tuple):
            loop.call_soon_threadsafe(queue.put_nowait, event)

        job.on_event = put
        self.submit(job)
        # runs in the thread that resolves the future, after that thread's last event: the order is kept
        job.future.add_done_callback(lambda f: _put_quietly(put, ("end", f)))
        return queue


# ----------------------------------------------------------------------------------------------------- app

def create_app(model_path: str | os.PathLike, cfg: ServerConfig | None = None, model=None, warmup: bool = True):
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    path = Path(model_path)
    cfg = cfg or ServerConfig()
    if model is None:
        from ..models import from_pretrained
        model = from_pretrained(path, dropless_impl=cfg.dropless_impl)
    srv = Server(model, path, cfg)

    @asynccontextmanager
    async def lifespan(app):
        srv.engine.start()
        if warmup:  # compile the programs before answering /health
            shapes = [(b, t) for b in (cfg.warmup_batch_sizes or [1]) for t in (cfg.warmup_prompt_lens or [1])]
            for b, t in shapes:
                p = min(t, srv.context - 2)
                max_tokens = cfg.warmup_max_tokens
                if cfg.batching == "continuous":  # a continuous request must fit a cache row
                    max_tokens = max(1, min(max_tokens, srv.context - p))
                job = Job([[0] * p] * b, 1, max_tokens, 0.0, None, None, concurrent.futures.Future())
                await asyncio.to_thread(srv.engine.warmup, job)
            log.info("warmed up %d batch shapes", len(shapes))
        yield
        srv.engine.stop()

    app = FastAPI(title="tutel-jax OpenAI-compatible server", lifespan=lifespan)
    app.state.server = srv

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse(APIError(500, f"internal error: {exc}", code="internal_error",
                                     type="server_error").body(), status_code=500)

    async def _json(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json")
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object", code="invalid_json")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _bad("'model' must be a string", "model", "invalid_type")
        return body

    @app.get("/health")
    async def health():
        return {"status": "ok", "batching": cfg.batching, "in_flight": srv.engine._inflight,
                **srv.engine.stats()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": srv.name, "object": "model", "created": srv.created,
                                            "owned_by": "tutel-jax", "max_model_len": srv.context}]}

    def _usage(job: Job, rows: list[list[int]]) -> dict:
        prompt = sum(len(p) for p in job.prompts)
        completion = sum(len(r) for r in rows)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    async def _stream(job: Job, queue: asyncio.Queue, base: dict, choice: Callable, opening: list[dict],
                      include_usage: bool):
        """Server-sent events of a streaming job: the `opening` choices, one chunk per token as the worker
        produces it, a finish chunk per row, then usage (if asked) and [DONE]; an error event if the batch
        fails. `choice(index, text, token_ids, finish_reason)` shapes a chunk's choice."""
        try:
            for c in opening:
                yield _sse({**base, "choices": [c]})
            while True:
                event = await queue.get()
                if event[0] == "token":
                    _, i, token, delta = event
                    yield _sse({**base, "choices": [choice(i, delta, [token], None)]})
                elif event[0] == "finish":
                    _, i, rest, reason = event
                    yield _sse({**base, "choices": [choice(i, rest, [], reason)]})
                else:  # ("end", future)
                    exc = event[1].exception()
                    if exc is not None:
                        err = exc if isinstance(exc, APIError) else APIError(
                            500, f"generation failed: {exc}", code="internal_error", type="server_error")
                        yield _sse(err.body())
                        return
                    if include_usage:
                        yield _sse({**base, "choices": [], "usage": _usage(job, [c[0] for c in event[1].result()])})
                    yield "data: [DONE]\n\n"
                    return
        finally:  # also when the client disconnects: the worker finishes this job's rows at its next step
            job.cancelled = True

    def _include_usage(body: dict) -> bool:
        return bool((body.get("stream_options") or {}).get("include_usage"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json(request)
        prompts = srv._prompt_ids(body.get("prompt"))
        job, opts = srv._common(body, prompts, cfg.default_max_tokens)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if opts["stream"]:
            queue = srv.stream(job)
            base = {"id": rid, "object": "text_completion", "created": created, "model": srv.name}

            def choice(i, text, token_ids, reason):
                return {"index": i, "text": text, "logprobs": None, "finish_reason": reason, "token_ids": token_ids}

            return StreamingResponse(_stream(job, queue, base, choice, [], _include_usage(body)),
                                     media_type="text/event-stream")
        done = await srv.run(job)
        return {"id": rid, "object": "text_completion", "created": created, "model": srv.name,
                "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": reason,
                             "token_ids": ids} for i, (ids, text, reason) in enumerate(done)],
                "usage": _usage(job, [d[0] for d in done])}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _json(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise _bad("'messages' must be a non-empty list of {role, content} objects", "messages",
                       "invalid_type")
        ids = srv.codec.chat_prompt(messages)
        srv._check_ids(ids, "messages")
        job, opts = srv._common(body, [ids], cfg.default_max_tokens)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if opts["stream"]:
            queue = srv.stream(job)
            base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": srv.name}

            def choice(i, text, token_ids, reason):
                delta = {"content": text} if text or reason is None else {}
                return {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason,
                        "token_ids": token_ids}

            opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None} for i in range(job.rows)]
            return StreamingResponse(_stream(job, queue, base, choice, opening, _include_usage(body)),
                                     media_type="text/event-stream")
        done = await srv.run(job)
        return {"id": rid, "object": "chat.completion", "created": created, "model": srv.name,
                "choices": [{"index": i, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": reason, "token_ids": t}
                            for i, (t, text, reason) in enumerate(done)], "usage": _usage(job, [d[0] for d in done])}

    return app


def _parser():
    from ..cli_args import CommandParser, int_at_least, int_in_range, non_negative_float
    from ..dropless import IMPLS
    p = CommandParser(prog="tutel-jax serve", description="OpenAI-compatible server for a tutel-jax checkpoint "
                      "(GET /health, /v1/models; POST /v1/completions, /v1/chat/completions)")
    p.add_argument("checkpoint", help="HF checkpoint directory (config.json + safetensors [+ tokenizer.json])")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int_in_range(0, 65535), default=8000, help="0: any free port")
    p.add_argument("--batching", choices=["continuous", "bucketed"], default="continuous",
                   help="continuous: requests join and leave a running decode batch at every step (default); "
                        "bucketed: compatible requests are gathered into one generate call at a time")
    p.add_argument("--max-batch-size", type=int_at_least(1), default=16,
                   help="rows (prompts x n) decoded together (continuous: the KV cache's rows)")
    p.add_argument("--max-len", type=int_at_least(2), default=None,
                   help="continuous: KV cache slots per row, which caps prompt + max_tokens (default: the "
                        "model's context, at most 2048)")
    p.add_argument("--row-buckets", action=argparse.BooleanOptionalAction, default=True,
                   help="continuous: each decode step runs only the leading power-of-two rows that hold running "
                        "requests (cheaper steps at low load; one decode compile per power of two, compiled "
                        "at startup for the --warmup-batch-sizes); --no-row-buckets: always all rows, one "
                        "compile")
    p.add_argument("--batch-wait-ms", type=non_negative_float, default=5.0,
                   help="bucketed: how long a batch is gathered")
    p.add_argument("--max-queue", type=int_at_least(1), default=256,
                   help="requests waiting or running; beyond: 429")
    p.add_argument("--max-tokens", type=int_at_least(1), default=512, help="upper bound on a request's max_tokens")
    p.add_argument("--model-name", default=None, help="the model id in the API (default: the directory name)")
    p.add_argument("--no-warmup", action="store_true", help="answer at once; compile on the first requests")
    p.add_argument("--warmup-batch-sizes", type=int_at_least(1), nargs="*", default=None,
                   help="batch sizes to compile at startup (rows are padded to powers of two; continuous: "
                        "prefill group sizes; default 1)")
    p.add_argument("--warmup-prompt-lens", type=int_at_least(1), nargs="*", default=None,
                   help="prompt lengths to compile at startup (bucketed: padded to multiples of 16; continuous: "
                        "to powers of two >= 16; default 1)")
    p.add_argument("--warmup-max-tokens", type=int_at_least(1), default=2,
                   help="max_tokens of the warmup batches (the KV cache length is prompt + max_tokens, "
                        "rounded up to 16)")
    p.add_argument("--dropless-impl", default="auto", choices=IMPLS,
                   help="how the MoE layers run their experts ('native': the C++ CPU kernel, fastest on CPU)")
    p.add_argument("--log-level", default="info", type=str.lower,
                   choices=["critical", "error", "warning", "info", "debug"])
    return p


def main(argv=None) -> int:
    """`tutel-jax serve`: parses the flags, loads the checkpoint and serves until stopped. Every error before
    serving (a bad flag, a checkpoint that cannot be loaded, a missing `serve` extra) is one line on stderr,
    `tutel-jax serve: error: ...`, and exit code 2."""
    p = _parser()
    a = p.parse_args(argv)
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        return p.fail(f"the server needs the `serve` extra (pip install tutel-jax[serve]): {e}")
    from ..native import NativeKernelError
    logging.basicConfig(level=a.log_level.upper())
    cfg = ServerConfig(max_batch_size=a.max_batch_size, batch_wait_ms=a.batch_wait_ms, max_queue=a.max_queue,
                       batching=a.batching, max_len=a.max_len, row_buckets=a.row_buckets,
                       max_tokens_limit=a.max_tokens, model_name=a.model_name,
                       warmup_batch_sizes=a.warmup_batch_sizes, warmup_prompt_lens=a.warmup_prompt_lens,
                       warmup_max_tokens=a.warmup_max_tokens, dropless_impl=a.dropless_impl)
    try:
        app = create_app(a.checkpoint, cfg, warmup=not a.no_warmup)
    except (ValueError, OSError, NativeKernelError) as e:  # a bad checkpoint / option: one line, no traceback
        return p.fail(f"cannot load {a.checkpoint}: {e}")
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level, timeout_graceful_shutdown=30)
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main())
