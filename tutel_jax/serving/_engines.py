"""The server's batching engines: a `Job` per request, and the background worker thread that runs them.

`ContinuousEngine` (continuous batching over one persistent KV cache, `continuous.ContinuousBatcher`) and
`Engine` (bucketed: compatible jobs gathered into one `generate` call) share `_Worker`: the job queue, the
in-flight bound (QueueFull beyond it) and the stop protocol. Each job's future resolves to one `Completion` per
row (prompt x n) as soon as its rows are done; streaming jobs also get per-token events."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Callable

import numpy as np

from ._api_errors import APIError, bad_request, generation_error
from ._continuous import ContinuousBatcher, Request
from ._generate import generate, left_pad
from ._server_config import ServerConfig
from ._tokenizer import IncrementalDecoder, TextCodec

log = logging.getLogger("tutel_jax.serving")

#: an idle continuous engine gathers jobs for up to this fraction of its last decode step (at least batch_wait_ms)
GATHER_STEP_FRACTION = 0.25

__all__ = ["Completion", "ContinuousEngine", "Engine", "Job", "QueueFull", "finish_completion"]

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
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs added to the logits (checked)

    def bucket(self):
        if self.logit_bias:  # its bias applies to every row of a bucketed batch: it runs alone
            return ("biased", id(self))
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

    def gather_window_s(self) -> float:
        """How long the worker gathers jobs after the first one: cfg.batch_wait_ms."""
        return self.cfg.batch_wait_ms / 1000.0

    def _gather(self):
        """With the lock held and a job pending: waits up to `gather_window_s()` for more jobs (until
        cfg.max_batch_size rows are pending), so that requests sent together start together."""
        deadline = time.monotonic() + self.gather_window_s()
        while not self._stop and sum(j.rows for j in self._pending) < self.cfg.max_batch_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._cv.wait(left)

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
            self._gather()
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
                        job.future.set_exception(generation_error(e))
            finally:
                with self._cv:
                    self._inflight -= len(batch)
                self.batches_run += 1
        self._fail_pending()  # shutting down: fail what is left

    def run_batch(self, batch: list[Job]) -> list[list[Completion]]:
        """Runs the jobs as one batch; per job, per (prompt, n) row: its Completion. Each job's future is
        resolved when its last row is done, and generation stops once every row is."""
        rows = [_Row(j, k, self.codec) for j in batch for k in range(len(j.prompts) * j.n)]
        prompts = [p for j in batch for p in j.prompts for _ in range(j.n)]
        B = 1 << (len(prompts) - 1).bit_length()  # pad rows to a power of two
        T = -(-max(len(p) for p in prompts) // 16) * 16
        ids, mask, _ = left_pad(prompts + [[self.pad]] * (B - len(prompts)), self.pad, T)  # dummy rows: one pad
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
                 top_p=j0.top_p, seed=seed, stream_callback=on_step, logit_bias=dict(j0.logit_bias) or None)
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
    into an idle engine until it is idle again); decode_steps and prefills the steps run. cfg.row_buckets: decode
    steps run only the leading power-of-two rows holding running requests (see ContinuousBatcher). An idle
    engine gathers jobs after the first one, so that requests sent together share one prefill instead of the
    first one's prefill and decode steps delaying the others': for cfg.batch_wait_ms, or GATHER_STEP_FRACTION
    of the last decode step when that is longer (clients answered by one step send their next requests over
    some milliseconds; where a step takes 100s of ms, as on a CPU, a request that misses a 5 ms window costs the
    others a prefill of its own, while waiting costs a lone request at most that fraction of a step)."""

    def __init__(self, model, cfg: ServerConfig, pad_token_id: int = 0, codec: TextCodec | None = None,
                 max_len: int = 256):
        super().__init__(model, cfg, pad_token_id, codec)
        self.max_len = max_len
        self.batcher = None
        self._jobs: dict[int, tuple[Job, list[_Row]]] = {}  # running jobs by id(job)

    def start(self):
        self.batcher = ContinuousBatcher(self.model, self.cfg.max_batch_size, self.max_len,
                                         row_buckets=self.cfg.row_buckets)
        super().start()

    def warmup(self, job: Job) -> list[Completion]:
        self.submit(job)
        return job.future.result()

    def gather_window_s(self) -> float:
        """How long an idle engine gathers jobs after the first one (see the class docstring)."""
        last = 0.0 if self.batcher is None else self.batcher.last_decode_s
        return max(super().gather_window_s(), GATHER_STEP_FRACTION * last)

    def stats(self) -> dict:
        return {"batches_run": self.batches_run,
                "decode_steps": 0 if self.batcher is None else self.batcher.decode_steps,
                "prefills": 0 if self.batcher is None else self.batcher.prefills}

    def _loop(self):
        b = self.batcher
        while True:
            with self._cv:
                while not self._pending and b.idle and not self._stop:
                    self._cv.wait()
                if not self._pending and b.idle:  # stopping, and everything is answered
                    break
                if b.idle:  # a busy period starts: requests sent together are prefilled together
                    self._gather()
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
                self._fail_running(generation_error(e))
            else:
                for req in done:
                    if req.error is not None:  # non-finite logits: that request fails, the others run on
                        self._fail_request(req)
            self._resolve()
        self._fail_pending()

    def _admit(self, job: Job):
        """Queues the job's rows in the batcher (one Request per prompt x choice)."""
        seed = job.seed if job.seed is not None else int.from_bytes(os.urandom(4), "little")
        rows, reqs = [], []
        for k, prompt in enumerate(p for p in job.prompts for _ in range(job.n)):
            row = _Row(job, k, self.codec)
            rows.append(row)
            row.req = Request(prompt=list(prompt), max_new_tokens=job.max_tokens, temperature=job.temperature,
                              top_p=job.top_p, seed=seed, sample_id=k, on_token=functools.partial(_on_token, row),
                              logit_bias=dict(job.logit_bias) or None)
            reqs.append(row.req)
        self._jobs[id(job)] = (job, rows)
        try:
            for req in reqs:
                self.batcher.add(req)
        except ValueError as e:  # cannot happen after the server's checks; never leave the request hanging
            self.batcher.waiting = collections.deque(r for r in self.batcher.waiting if r not in reqs)
            del self._jobs[id(job)]
            self._finish_job(job, exc=bad_request(str(e), "max_tokens", getattr(e, "code", "context_length_exceeded")))

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
                self._finish_job(job, exc=generation_error(req.error))
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
