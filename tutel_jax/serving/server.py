"""OpenAI-compatible HTTP server for a tutel-jax CausalLM (FastAPI + uvicorn), with dynamic batching.

    python -m tutel_jax.serving.server CHECKPOINT --host 127.0.0.1 --port 8000

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions.
Prompts are token-id lists (or lists of them); text prompts need a tokenizer.json next to the checkpoint and the
`tokenizers` package; chat needs a tokenizer plus a chat template (tokenizer_config.json) and `jinja2`.
Choices always carry the generated ids as the extra field `token_ids` (`text` is "" without a tokenizer).

Requests are queued and a background worker thread gathers up to --max_batch_size rows within --batch_wait_ms,
groups compatible ones (greedy with greedy; sampled ones by temperature/top_p; a seeded sampled request runs
alone so its result depends only on its seed), pads the batch (rows to a power of two, prompt columns to a
multiple of 16: fewer recompiles) and runs one `generate` call. Streaming sends the tokens as server-sent
events once the request's batch has finished (no per-token streaming yet).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

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


# ----------------------------------------------------------------------------------------------------- config

@dataclasses.dataclass
class ServerConfig:
    max_batch_size: int = 16        # rows (prompts x n) per generate call
    batch_wait_ms: float = 5.0      # how long the worker gathers requests after the first one
    max_queue: int = 256            # requests waiting or running; beyond: 429
    max_tokens_limit: int = 512     # upper bound on a request's max_tokens
    max_n: int = 16
    default_max_tokens: int = 16
    model_name: str | None = None
    warmup_batch_sizes: list[int] | None = None    # compiled at startup (rows); default [1]
    warmup_prompt_lens: list[int] | None = None    # with these prompt lengths; default [1]
    warmup_max_tokens: int = 2


def _context_length(config: dict) -> int:
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
        if isinstance(config.get(key), int):
            return config[key]
    return 2048


def _eos_ids(path: Path, config: dict) -> set[int]:
    ids: set[int] = set()
    sources = [config]
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            sources.append(json.loads(gen.read_text()))
        except ValueError:
            pass
    for src in sources:
        e = src.get("eos_token_id")
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, list):
            ids.update(x for x in e if isinstance(x, int))
    return ids


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
            f = self.path / "tokenizer.json"
            if f.is_file():
                try:
                    from tokenizers import Tokenizer  # optional dependency
                    self._tok = Tokenizer.from_file(str(f))
                except Exception as e:  # noqa: BLE001 - missing package or unreadable file
                    log.warning("tokenizer.json not usable (%s); token-id prompts only", e)
        return self._tok

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise _bad("this model has no tokenizer (no tokenizer.json or the `tokenizers` package is missing): "
                       "send the prompt as a list of token ids", "prompt", "tokenizer_unavailable")
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

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

@dataclasses.dataclass
class Job:
    prompts: list[list[int]]        # each repeated n times
    n: int
    max_tokens: int
    temperature: float
    top_p: float | None
    seed: int | None
    future: concurrent.futures.Future
    rows: int = 0

    def bucket(self):
        if self.temperature == 0.0:
            return ("greedy",)
        if self.seed is not None:
            return ("seeded", id(self))
        return ("sample", self.temperature, self.top_p)


class QueueFull(Exception):
    pass


class Engine:
    """Background worker: collects Jobs, runs one `generate` per compatible batch, resolves their futures."""

    def __init__(self, model, cfg: ServerConfig, pad_token_id: int = 0):
        self.model, self.cfg, self.pad = model, cfg, pad_token_id
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
                results = self.run_batch(batch)
                for job, res in zip(batch, results):
                    job.future.set_result(res)
            except Exception as e:  # noqa: BLE001 - report to the clients, keep serving
                log.exception("batch failed")
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(APIError(500, f"generation failed: {e}", code="internal_error",
                                                          type="server_error"))
            finally:
                with self._cv:
                    self._inflight -= len(batch)
                self.batches_run += 1
        self._fail_pending()  # shutting down: fail what is left

    def run_batch(self, batch: list[Job]) -> list[list[list[int]]]:
        """Per job, per (prompt, n) row: the generated ids (max_tokens of them, before stop handling)."""
        from .generate import generate
        rows = [p for j in batch for p in j.prompts for _ in range(j.n)]
        B = 1 << (len(rows) - 1).bit_length()  # pad rows to a power of two
        B = max(B, len(rows))
        T = -(-max(len(p) for p in rows) // 16) * 16
        ids = np.full((B, T), self.pad, np.int32)
        mask = np.zeros((B, T), np.int32)
        for b, p in enumerate(rows):
            ids[b, T - len(p):] = p
            mask[b, T - len(p):] = 1
        mask[len(rows):, -1] = 1  # dummy rows: one pad token
        N = max(j.max_tokens for j in batch)
        j0 = batch[0]
        seed = j0.seed if j0.seed is not None else int.from_bytes(os.urandom(4), "little")
        res = generate(self.model, ids, N, attention_mask=mask, pad_token_id=self.pad,
                       temperature=float(j0.temperature), top_p=j0.top_p, seed=seed)
        out, r = [], 0
        for j in batch:
            job_rows = []
            for _ in range(len(j.prompts) * j.n):
                job_rows.append(res.tokens[r, :j.max_tokens].tolist())
                r += 1
            out.append(job_rows)
        return out


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


def _float(body: dict, name: str, default, lo: float, hi: float) -> float:
    v = body.get(name, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(f"'{name}' must be a number, got {type(v).__name__}", name, "invalid_type")
    if not lo <= v <= hi:
        raise _bad(f"'{name}' must be between {lo} and {hi}, got {v}", name)
    return float(v)


def _is_ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


class Server:
    def __init__(self, model, path: Path, cfg: ServerConfig):
        self.model, self.path, self.cfg = model, path, cfg
        self.context = _context_length(model.config)
        v = model.config.get("vocab_size")
        self.vocab = v if isinstance(v, int) else None
        self.eos = _eos_ids(path, model.config)
        pad = model.config.get("pad_token_id")
        self.engine = Engine(model, cfg, pad if isinstance(pad, int) else 0)
        self.codec = TextCodec(path)
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
        room = self.context - longest
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = min(default_max, room)
        else:
            max_tokens = _int({"max_tokens": max_tokens}, "max_tokens", None, 1, self.cfg.max_tokens_limit)
        if longest + max_tokens > self.context:
            raise _bad(f"prompt ({longest} tokens) + max_tokens ({max_tokens}) exceeds this model's context of "
                       f"{self.context} tokens", "max_tokens", "context_length_exceeded")
        n = _int(body, "n", 1, 1, self.cfg.max_n)
        if len(prompts) * n > self.cfg.max_batch_size:
            raise _bad(f"len(prompt) * n = {len(prompts) * n} exceeds the server's max batch size "
                       f"{self.cfg.max_batch_size}", "n")
        temperature = _float(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _float(body, "top_p", 1.0, 0.0, 1.0)
        if top_p == 0.0:
            temperature = 0.0
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
                  top_p=None if top_p >= 1.0 else top_p, seed=seed, future=concurrent.futures.Future())
        return job, {"stream": bool(stream), "stop_ids": stop_ids, "stop_strs": stop_strs}

    def finish(self, toks: list[int], opts: dict) -> tuple[list[int], str, str]:
        """(ids, text, finish_reason) after stop handling."""
        reason = "length"
        for i, t in enumerate(toks):
            if t in opts["stop_ids"]:
                toks, reason = toks[:i], "stop"
                break
        text = self.codec.decode(toks)
        for s in opts["stop_strs"]:
            k = text.find(s)
            if k >= 0:
                text, reason = text[:k], "stop"
                # the ids whose text stays within the cut
                while toks and len(self.codec.decode(toks)) > len(text):
                    toks = toks[:-1]
        return toks, text, reason

    async def run(self, job: Job) -> list[list[int]]:
        try:
            self.engine.submit(job)
        except QueueFull:
            raise APIError(429, "the server's request queue is full; retry later", code="queue_full",
                           type="rate_limit_error")
        return await asyncio.wrap_future(job.future)


# ----------------------------------------------------------------------------------------------------- app

def create_app(model_path: str | os.PathLike, cfg: ServerConfig | None = None, model=None, warmup: bool = True):
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    path = Path(model_path)
    cfg = cfg or ServerConfig()
    if model is None:
        from ..models import from_pretrained
        model = from_pretrained(path)
    srv = Server(model, path, cfg)

    @asynccontextmanager
    async def lifespan(app):
        srv.engine.start()
        if warmup:  # compile the programs before answering /health
            shapes = [(b, t) for b in (cfg.warmup_batch_sizes or [1]) for t in (cfg.warmup_prompt_lens or [1])]
            for b, t in shapes:
                job = Job([[0] * min(t, srv.context - 2)] * b, 1, cfg.warmup_max_tokens, 0.0, None, None,
                          concurrent.futures.Future())
                await asyncio.to_thread(srv.engine.run_batch, [job])
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
        return {"status": "ok", "in_flight": srv.engine._inflight, "batches_run": srv.engine.batches_run}

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

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json(request)
        prompts = srv._prompt_ids(body.get("prompt"))
        job, opts = srv._common(body, prompts, cfg.default_max_tokens)
        rows = await srv.run(job)
        done = [srv.finish(r, opts) for r in rows]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        usage = _usage(job, [d[0] for d in done])
        if not opts["stream"]:
            return {"id": rid, "object": "text_completion", "created": created, "model": srv.name,
                    "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": reason,
                                 "token_ids": ids} for i, (ids, text, reason) in enumerate(done)],
                    "usage": usage}

        def events():
            base = {"id": rid, "object": "text_completion", "created": created, "model": srv.name}
            for i, (ids, text, reason) in enumerate(done):
                sent = 0  # characters of `text` sent so far: the pieces always add up to the final text
                for k, t in enumerate(ids):
                    upto = min(len(text), len(srv.codec.decode(ids[:k + 1])))
                    yield _sse({**base, "choices": [{"index": i, "text": text[sent:upto], "logprobs": None,
                                                     "finish_reason": None, "token_ids": [t]}]})
                    sent = max(sent, upto)
                yield _sse({**base, "choices": [{"index": i, "text": text[sent:], "logprobs": None,
                                                 "finish_reason": reason, "token_ids": []}]})
            if (body.get("stream_options") or {}).get("include_usage"):
                yield _sse({**base, "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

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
        rows = await srv.run(job)
        done = [srv.finish(r, opts) for r in rows]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        usage = _usage(job, [d[0] for d in done])
        if not opts["stream"]:
            return {"id": rid, "object": "chat.completion", "created": created, "model": srv.name,
                    "choices": [{"index": i, "message": {"role": "assistant", "content": text},
                                 "logprobs": None, "finish_reason": reason, "token_ids": t}
                                for i, (t, text, reason) in enumerate(done)], "usage": usage}

        def events():
            base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": srv.name}
            for i, (t, text, reason) in enumerate(done):
                yield _sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]})
                if text:
                    yield _sse({**base, "choices": [{"index": i, "delta": {"content": text}, "logprobs": None,
                                                     "finish_reason": None}]})
                yield _sse({**base, "choices": [{"index": i, "delta": {}, "logprobs": None,
                                                 "finish_reason": reason}]})
            if (body.get("stream_options") or {}).get("include_usage"):
                yield _sse({**base, "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main(argv=None):
    p = argparse.ArgumentParser(description="OpenAI-compatible server for a tutel-jax checkpoint")
    p.add_argument("checkpoint", help="HF checkpoint directory (config.json + safetensors [+ tokenizer.json])")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max_batch_size", type=int, default=16)
    p.add_argument("--batch_wait_ms", type=float, default=5.0)
    p.add_argument("--max_queue", type=int, default=256)
    p.add_argument("--max_tokens", type=int, default=512, help="upper bound on a request's max_tokens")
    p.add_argument("--model_name", default=None)
    p.add_argument("--no_warmup", action="store_true")
    p.add_argument("--warmup_batch_sizes", type=int, nargs="*", default=None,
                   help="batch sizes to compile at startup (rows are padded to powers of two; default 1)")
    p.add_argument("--warmup_prompt_lens", type=int, nargs="*", default=None,
                   help="prompt lengths to compile at startup (padded to multiples of 16; default 1)")
    p.add_argument("--warmup_max_tokens", type=int, default=2,
                   help="max_tokens of the warmup batches (the KV cache length is prompt + max_tokens, "
                        "rounded up to 16)")
    p.add_argument("--log_level", default="info")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper())
    import uvicorn
    cfg = ServerConfig(max_batch_size=a.max_batch_size, batch_wait_ms=a.batch_wait_ms, max_queue=a.max_queue,
                       max_tokens_limit=a.max_tokens, model_name=a.model_name,
                       warmup_batch_sizes=a.warmup_batch_sizes, warmup_prompt_lens=a.warmup_prompt_lens,
                       warmup_max_tokens=a.warmup_max_tokens)
    app = create_app(a.checkpoint, cfg, warmup=not a.no_warmup)
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level, timeout_graceful_shutdown=30)


if __name__ == "__main__":
    main()
