"""OpenAI-compatible HTTP server for a tutel-jax CausalLM (FastAPI + uvicorn), with dynamic batching.

    tutel-jax serve CHECKPOINT --host 127.0.0.1 --port 8000
    python -m tutel_jax.serving CHECKPOINT --host 127.0.0.1 --port 8000     (the same)

Endpoints: GET /health, GET /v1/models, GET /v1/models/{id}, POST /v1/completions, POST /v1/chat/completions.
The model is served under --served-model-name (default: the checkpoint directory's name); a request naming
another model gets 404 model_not_found. Every error has the OpenAI shape {"error": {message, type, param, code}}.
Non-streamed responses carry `usage`; streamed ones end with a usage chunk when `stream_options.include_usage`.
Prompts are token-id lists (or lists of them); text prompts need a tokenizer.json next to the checkpoint and the
`tokenizers` package; chat needs a tokenizer plus a chat template (tokenizer_config.json or chat_template.jinja)
and `jinja2`. Nothing from the checkpoint or a request is trusted: the checkpoint's files must stay inside its
directory, its chat template renders in jinja2's sandbox within --template-max-chars, --template-max-iterations
and --template-timeout (a template that is not valid Jinja or uses internals stops the server at startup), and
a request's text never becomes a control token (see `tokenizer.TextCodec.chat_prompt`).
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

Limits: a body over --max-request-bytes is answered 413 before it is read; headers or a body that take longer
than --read-timeout seconds to arrive get 408 (slow clients cannot hold the server); a request's prompts x n
must fit --max-batch-size; JSON nested too deeply is a 400. The modules: `api_requests` (validation, one schema
per endpoint), `engines` (batching), `app` (routes), `http_guard` (HTTP limits), `server_config`.
"""

from __future__ import annotations

import argparse
import logging
import socket

from ..layer import execution
from ..cli_args import (CommandParser, add_compile_cache_argument, add_dtype_argument, int_at_least, int_in_range,
                        non_negative_float, positive_float)
from ..core import enable_compile_cache
from ..native import NativeKernelError
from ._api_errors import APIError
from ._app import Server, create_app
from ._engines import Completion, ContinuousEngine, Engine, Job, QueueFull, finish_completion
from ._http_guard import guarded_h11_protocol
from ._server_config import ServerConfig

__all__ = ["APIError", "Completion", "ContinuousEngine", "Engine", "Job", "QueueFull", "Server", "ServerConfig",
           "create_app", "finish_completion", "main"]


def _parser():
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
                   help="how long requests are gathered after the first one (continuous: into an idle engine, "
                        "at least a quarter of its last decode step)")
    p.add_argument("--max-queue", type=int_at_least(1), default=256,
                   help="requests waiting or running; beyond: 429")
    p.add_argument("--max-tokens", type=int_at_least(1), default=512, help="upper bound on a request's max_tokens")
    p.add_argument("--served-model-name", "--model-name", dest="model_name", default=None,
                   help="the model id in the API; requests naming another model get 404 (default: the "
                        "checkpoint directory's name)")
    p.add_argument("--max-request-bytes", type=int_at_least(1), default=ServerConfig.max_request_bytes,
                   help="a larger request body is answered 413 before it is read (default: 4 MiB)")
    p.add_argument("--read-timeout", type=positive_float, default=ServerConfig.read_timeout_s,
                   help="seconds a request's headers, and then its body, may take to arrive; slower: 408")
    p.add_argument("--template-max-chars", type=int_at_least(1), default=ServerConfig.template_max_chars,
                   help="characters a chat template's rendered prompt, and any string or list it builds, may hold "
                        "(default: 4 Mi)")
    p.add_argument("--template-max-iterations", type=int_at_least(1),
                   default=ServerConfig.template_max_iterations,
                   help="loop iterations one chat template render may run, all loops together")
    p.add_argument("--template-timeout", type=positive_float, default=ServerConfig.template_timeout_s,
                   help="seconds one chat template render may take")
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
    add_dtype_argument(p)
    add_compile_cache_argument(p)
    p.add_argument("--log-level", default="info", type=str.lower,
                   choices=["critical", "error", "warning", "info", "debug"])
    execution.add_arguments(p)
    return p


def _address_problem(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port (an unknown host, a port in use), or None."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as e:
        return f"--host {host!r}: not an address of this machine ({e})"
    family, kind, proto, _, address = infos[0]
    try:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            s.bind(address)
    except OSError as e:
        return f"--host {host!r} --port {port}: cannot listen there ({e.strerror or e})"
    return None


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
    try:
        knobs = execution.from_arguments(a, allowed=execution.MODEL_KNOBS)
    except ValueError as e:
        return p.fail(str(e))
    problem = _address_problem(a.host, a.port)
    if problem:  # before the (long) load
        return p.fail(problem)
    try:
        enable_compile_cache(a.compile_cache)
    except ValueError as e:
        return p.fail(str(e))
    logging.basicConfig(level=a.log_level.upper())
    cfg = ServerConfig(max_batch_size=a.max_batch_size, batch_wait_ms=a.batch_wait_ms, max_queue=a.max_queue,
                       batching=a.batching, max_len=a.max_len, row_buckets=a.row_buckets,
                       max_tokens_limit=a.max_tokens, model_name=a.model_name,
                       warmup_batch_sizes=a.warmup_batch_sizes, warmup_prompt_lens=a.warmup_prompt_lens,
                       warmup_max_tokens=a.warmup_max_tokens, execution=knobs, dtype=a.dtype,
                       max_request_bytes=a.max_request_bytes, read_timeout_s=a.read_timeout,
                       template_max_chars=a.template_max_chars, template_max_iterations=a.template_max_iterations,
                       template_timeout_s=a.template_timeout)
    try:
        app = create_app(a.checkpoint, cfg, warmup=not a.no_warmup)
    except (ValueError, OSError, NativeKernelError) as e:  # a bad checkpoint / option / template: one line
        return p.fail(f"cannot load {a.checkpoint}: {e}")
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level, timeout_graceful_shutdown=30,
                http=guarded_h11_protocol(a.read_timeout))
    return 0

