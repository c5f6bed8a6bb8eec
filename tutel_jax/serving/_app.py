"""The OpenAI-compatible FastAPI app: `create_app(checkpoint, ServerConfig)`.

Routes: GET /health, GET /v1/models, GET /v1/models/{id}, POST /v1/completions, POST /v1/chat/completions.
`Server` owns the model, its `ModelLimits` and the batching engine; the routes parse a request
(`api_requests`), queue its Job and answer with the completions (or stream them as server-sent events).
Every error, unknown routes, wrong methods and validation errors included, has the OpenAI shape
`{"error": {"message", "type", "param", "code"}}`; `RequestGuard` bounds the body's size and read time."""

import asyncio
import concurrent.futures
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from .. import models as tutel_models
from ._api_errors import APIError, error_body
from ._api_requests import ModelLimits, ParsedRequest, parse_body, parse_chat, parse_completion
from ._chat_template import TemplateLimits
from ._engines import Completion, ContinuousEngine, Engine, Job, QueueFull
from ._http_guard import RequestGuard
from ._sampling import model_context
from ._server_config import ServerConfig
from ._tokenizer import TextCodec, eos_token_ids

log = logging.getLogger("tutel_jax.serving")

__all__ = ["Server", "create_app"]


def _context_length(config: dict) -> int:
    return model_context(config) or 2048


def _put_quietly(put: Callable[[tuple], None], event: tuple) -> None:
    try:
        put(event)
    except RuntimeError:  # the request's event loop is closed
        pass


class Server:
    """A loaded model behind one batching engine: `limits` for request validation, `submit` / `run` / `stream`
    for jobs."""

    def __init__(self, model: Any, path: Path, cfg: ServerConfig):
        self.model, self.path, self.cfg = model, path, cfg
        context = _context_length(model.config)
        v = model.config.get("vocab_size")
        pad = model.config.get("pad_token_id")
        pad = pad if isinstance(pad, int) else 0
        codec = TextCodec(path, TemplateLimits(max_chars=cfg.template_max_chars,
                                               max_iterations=cfg.template_max_iterations,
                                               timeout_s=cfg.template_timeout_s))
        codec.check()  # a tokenizer file leading out of the checkpoint or a bad template: refused at startup
        if cfg.batching == "continuous":
            context = min(context, cfg.max_len or 2048)  # a request must fit one cache row
            self.engine = ContinuousEngine(model, cfg, pad, codec, max_len=context)
        elif cfg.batching == "bucketed":
            self.engine = Engine(model, cfg, pad, codec)
        else:
            raise ValueError(f"batching must be 'continuous' or 'bucketed', got {cfg.batching!r}")
        name = cfg.model_name or path.resolve().name
        self.limits = ModelLimits(name=name, context=context, vocab=v if isinstance(v, int) else None,
                                  eos=frozenset(eos_token_ids(path, model.config)), codec=codec, cfg=cfg)
        self.created = int(time.time())

    @property
    def name(self) -> str:
        return self.limits.name

    @property
    def context(self) -> int:
        return self.limits.context

    def model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "tutel-jax",
                "max_model_len": self.context}

    def submit(self, job: Job) -> None:
        """Queues the job (429 when the queue is full)."""
        try:
            self.engine.submit(job)
        except QueueFull:
            raise APIError(429, "the server's request queue is full; retry later", code="queue_full",
                           type="rate_limit_error") from None

    async def run(self, job: Job) -> list[Completion]:
        """The job's completions (one per row) once all its rows are done."""
        self.submit(job)
        return await asyncio.wrap_future(job.future)

    def stream(self, job: Job) -> asyncio.Queue:
        """Queues a streaming job; its events arrive in the returned queue (filled from the worker thread), then
        ("end", future) once the job is resolved or failed."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()

        def put(event: tuple) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        job.on_event = put
        self.submit(job)
        # runs in the thread that resolves the future, after that thread's last event: the order is kept
        job.future.add_done_callback(lambda f: _put_quietly(put, ("end", f)))
        return queue

    async def warmup(self) -> None:
        """Compiles the configured batch shapes (before /health answers)."""
        cfg = self.cfg
        shapes = [(b, t) for b in (cfg.warmup_batch_sizes or [1]) for t in (cfg.warmup_prompt_lens or [1])]
        for b, t in shapes:
            p = min(t, self.context - 2)
            max_tokens = cfg.warmup_max_tokens
            if cfg.batching == "continuous":  # a continuous request must fit a cache row
                max_tokens = max(1, min(max_tokens, self.context - p))
            job = Job([[0] * p] * b, 1, max_tokens, 0.0, None, None, concurrent.futures.Future())
            await asyncio.to_thread(self.engine.warmup, job)
        log.info("warmed up %d batch shapes", len(shapes))


def _usage(job: Job, rows: list[list[int]]) -> dict:
    prompt = sum(len(p) for p in job.prompts)  # each prompt counted once, as OpenAI does for n > 1
    completion = sum(len(r) for r in rows)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _stream_events(job: Job, queue: asyncio.Queue, base: dict, choice: Callable, opening: list[dict],
                         include_usage: bool):
    """Server-sent events of a streaming job: the `opening` choices, one chunk per token as the worker produces
    it, a finish chunk per row, then usage (if asked: every chunk before it has "usage": null) and [DONE]; an
    error event if the generation fails. `choice(index, text, token_ids, finish_reason)` shapes a choice."""
    if include_usage:
        base = {**base, "usage": None}
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


def _completion_choice(i: int, text: str, token_ids: list[int], reason: str | None) -> dict:
    return {"index": i, "text": text, "logprobs": None, "finish_reason": reason, "token_ids": token_ids}


def _chat_chunk_choice(i: int, text: str, token_ids: list[int], reason: str | None) -> dict:
    delta = {"content": text} if text or reason is None else {}
    return {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason, "token_ids": token_ids}


def _chat_choice(i: int, done: Completion) -> dict:
    ids, text, reason = done
    return {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": reason, "token_ids": ids}


def create_app(model_path: str | os.PathLike, cfg: ServerConfig | None = None, model: Any = None,
               warmup: bool = True):
    """The FastAPI app serving the checkpoint at `model_path` (loaded unless `model` is given)."""

    # the `serve` extra, imported here only: the routes' annotations (no `from __future__ import annotations` in
    # this module) are the objects themselves, so FastAPI sees `Request` without a module-level import
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    path = Path(model_path)
    cfg = cfg or ServerConfig()
    if model is None:
        model = tutel_models.from_pretrained(path, dtype=cfg.dtype, **cfg.execution.set_fields())
    srv = Server(model, path, cfg)

    @asynccontextmanager
    async def lifespan(app):
        srv.engine.start()
        if warmup:  # compile the programs before answering /health
            await srv.warmup()
        yield
        srv.engine.stop()

    app = FastAPI(title="tutel-jax OpenAI-compatible server", lifespan=lifespan)
    app.state.server = srv
    app.add_middleware(RequestGuard, max_body_bytes=cfg.max_request_bytes, read_timeout_s=cfg.read_timeout_s)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        kinds = {404: ("not_found_error", "not_found"), 405: ("invalid_request_error", "method_not_allowed")}
        type_, code = kinds.get(exc.status_code, ("invalid_request_error", None))
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(message, type_, None, code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return JSONResponse(error_body(f"invalid request: {first.get('msg', exc)}", param=param,
                                       code="invalid_value"), status_code=422)

    async def _body(request: Request) -> dict:
        return parse_body(await request.body())

    @app.get("/health")
    async def health():
        return {"status": "ok", "batching": cfg.batching, "in_flight": srv.engine._inflight,
                **srv.engine.stats()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [srv.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != srv.name:
            raise APIError(404, f"The model '{model_id}' does not exist; this server serves '{srv.name}'",
                           "model", "model_not_found")
        return srv.model_card()

    async def _answer(req: ParsedRequest, kind: str, choice: Callable, opening: list[dict], whole: Callable):
        job = req.job
        rid, created = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
            base = {"id": rid, "object": obj, "created": created, "model": srv.name}
            queue = srv.stream(job)
            return StreamingResponse(_stream_events(job, queue, base, choice, opening, req.include_usage),
                                     media_type="text/event-stream")
        done = await srv.run(job)
        return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": created, "model": srv.name, "choices": [whole(i, d) for i, d in enumerate(done)],
                "usage": _usage(job, [d[0] for d in done])}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_completion(await _body(request), srv.limits)
        return await _answer(req, "text", _completion_choice, [],
                             lambda i, d: _completion_choice(i, d[1], d[0], d[2]))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = parse_chat(await _body(request), srv.limits)
        opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for i in range(len(req.job.prompts) * req.job.n)]
        return await _answer(req, "chat", _chat_chunk_choice, opening, _chat_choice)

    return app
