"""Request validation, one schema per endpoint: a JSON body becomes a `ParsedRequest` (the engine's `Job` plus
the response options) or an `APIError` naming the field at fault (400; 404 for another model's name).

- `parse_body`: the raw body as a JSON object (invalid, truncated or too deeply nested JSON: 400 invalid_json).
- `parse_completion`: POST /v1/completions (`prompt`: a string, a list of strings, a token-id list, or a list of
  token-id lists).
- `parse_chat`: POST /v1/chat/completions (`messages`: {role, content} objects; content a string or text parts;
  without max_tokens it generates until a stop, the context's end or the server's --max-tokens). Fields that
  this server does not act on (`tools`, `user`, ...) are accepted and ignored.
Both share the sampling fields (`check_sampling`'s rules with the OpenAI caps: temperature in [0, 2], top_p 0 as
greedy, max_tokens at most the server's limit), `n`, `seed`, `stop`, `stream` and `stream_options`. A request's
prompts x n must fit the server's batch (checked before any prompt is tokenized)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
from typing import Any

from .api_errors import APIError, bad_request
from .engines import Job
from .sampling import SamplingParamError, check_sampling
from .server_config import ServerConfig
from .tokenizer import TextCodec, TextUnavailableError

__all__ = ["MAX_TEMPERATURE", "ModelLimits", "ParsedRequest", "parse_body", "parse_chat", "parse_completion"]

MAX_TEMPERATURE = 2.0  # the OpenAI API's cap
MAX_STOP_SEQUENCES = 16


@dataclasses.dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against: the served model's id, its context (prompt + max_tokens), vocabulary
    size (None: unknown), end-of-sequence ids, text support and the server's settings."""
    name: str
    context: int
    vocab: int | None
    eos: frozenset[int]
    codec: TextCodec
    cfg: ServerConfig


@dataclasses.dataclass
class ParsedRequest:
    job: Job
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object."""
    try:
        body = json.loads(raw)
    except RecursionError:  # the C scanner's guard: no deep recursion happens here or later
        raise APIError(400, "request body is not valid JSON: nested too deeply", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    return body


def _text_error(e: TextUnavailableError) -> APIError:
    return bad_request(str(e), e.param, e.code)


def _int(body: dict, name: str, default: Any, lo: int, hi: int) -> int:
    v = body.get(name, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"'{name}' must be an integer, got {type(v).__name__}", name, "invalid_type")
    if not lo <= v <= hi:
        raise bad_request(f"'{name}' must be between {lo} and {hi}, got {v}", name)
    return v


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _check_model(body: dict, limits: ModelLimits) -> None:
    model = body.get("model")
    if model is None:  # optional here: this server serves one model
        return
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", "model", "invalid_type")
    if model != limits.name:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{limits.name}' "
                       "(GET /v1/models)", "model", "model_not_found")


def _check_rows(count: int, n: int, limits: ModelLimits) -> None:
    if count * n > limits.cfg.max_batch_size:
        raise bad_request(f"len(prompt) * n = {count * n} exceeds the server's max batch size "
                          f"{limits.cfg.max_batch_size}", "n" if n > 1 else "prompt")


def _check_ids(p: list[int], param: str, limits: ModelLimits) -> None:
    if not p:
        raise bad_request("prompts must not be empty", param)
    if limits.vocab is not None and any(t < 0 or t >= limits.vocab for t in p):
        raise bad_request(f"token ids must be in [0, {limits.vocab})", param)
    if len(p) >= limits.context:
        raise bad_request(f"prompt has {len(p)} tokens; this model's context is {limits.context} tokens", param,
                          "context_length_exceeded")


def _prompts(prompt: Any, n: int, limits: ModelLimits) -> list[list[int]]:
    """The token ids of each prompt of a completions request."""
    try:
        if isinstance(prompt, str):
            prompts = [limits.codec.encode(prompt)]
        elif _is_ids(prompt) and prompt:
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            _check_rows(len(prompt), n, limits)
            prompts = [limits.codec.encode(p) for p in prompt]
        elif isinstance(prompt, list) and prompt and all(_is_ids(p) for p in prompt):
            prompts = [list(p) for p in prompt]
        elif prompt is None:
            raise bad_request("'prompt' is required", "prompt", "missing_required_parameter")
        else:
            raise bad_request("'prompt' must be a string, a list of strings, a list of token ids or a list of such "
                              "lists (and not empty)", "prompt", "invalid_type")
    except TextUnavailableError as e:
        raise _text_error(e) from None
    _check_rows(len(prompts), n, limits)
    for p in prompts:
        _check_ids(p, "prompt", limits)
    return prompts


def _stop(body: dict, limits: ModelLimits) -> tuple[frozenset[int], tuple[str, ...]]:
    stop_ids, stop_strs = set(limits.eos), []
    stop = body.get("stop")
    if stop is not None:
        items = stop if isinstance(stop, list) else [stop]
        if len(items) > MAX_STOP_SEQUENCES:
            raise bad_request(f"at most {MAX_STOP_SEQUENCES} stop sequences", "stop")
        for s in items:
            if isinstance(s, int) and not isinstance(s, bool):
                stop_ids.add(s)
            elif isinstance(s, str) and s:
                if limits.codec.tokenizer is None:
                    raise bad_request("string stop sequences need a tokenizer; this model has none: give stop "
                                      "token ids (integers)", "stop", "tokenizer_unavailable")
                stop_strs.append(s)
            else:
                raise bad_request("'stop' must be a string, a token id, or a list of them", "stop", "invalid_type")
    extra = body.get("stop_token_ids")
    if extra is not None:
        if not _is_ids(extra) or len(extra) > MAX_STOP_SEQUENCES:
            raise bad_request(f"'stop_token_ids' must be a list of at most {MAX_STOP_SEQUENCES} token ids",
                              "stop_token_ids", "invalid_type")
        stop_ids.update(extra)
    return frozenset(stop_ids), tuple(stop_strs)


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise bad_request("'stream' must be a boolean", "stream", "invalid_type")
    options = body.get("stream_options")
    if options is None:
        return bool(stream), False
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options", "invalid_type")
    include = options.get("include_usage", False)
    if not isinstance(include, bool) and include is not None:
        raise bad_request("'stream_options.include_usage' must be a boolean", "stream_options.include_usage",
                          "invalid_type")
    return True, bool(include)


def _parse(body: dict, prompts: list[list[int]], n: int, limits: ModelLimits, default_max: int) -> ParsedRequest:
    """The fields both endpoints share, applied to the request's prompts (`default_max`: max_tokens when the
    request gives none, bounded by the context left and the server's cap)."""
    cfg = limits.cfg
    longest = max(len(p) for p in prompts)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = min(default_max, limits.context - longest, cfg.max_tokens_limit)
    temperature = body.get("temperature")
    temperature = 1.0 if temperature is None else temperature
    top_p = body.get("top_p")
    # OpenAI accepts top_p 0 (only the most likely token): greedy
    top_p_greedy = isinstance(top_p, (int, float)) and not isinstance(top_p, bool) and top_p == 0
    try:  # the rules of `generate`, with the OpenAI caps
        params = check_sampling(max_tokens, temperature, None, None if top_p_greedy else top_p,
                                prompt_length=longest, context=limits.context, max_temperature=MAX_TEMPERATURE,
                                max_new_tokens_limit=cfg.max_tokens_limit, names={"max_new_tokens": "max_tokens"})
    except SamplingParamError as e:
        raise bad_request(str(e), e.param, e.code) from None
    top_p = params.top_p
    temperature = 0.0 if top_p_greedy else params.temperature
    seed = body.get("seed")
    if seed is not None:
        seed = _int(body, "seed", None, -(2 ** 63), 2 ** 63 - 1) % (2 ** 32)
    stream, include_usage = _stream_options(body)
    if body.get("logprobs") not in (None, False) or body.get("echo") or (body.get("best_of") or 1) != 1:
        raise bad_request("logprobs, echo and best_of are not supported by this server", "logprobs", "unsupported")
    stop_ids, stop_strs = _stop(body, limits)
    job = Job(prompts=prompts, n=n, max_tokens=params.max_new_tokens, temperature=temperature,
              top_p=None if top_p is None or top_p >= 1.0 else top_p, seed=seed,
              future=concurrent.futures.Future(), stop_ids=stop_ids, stop_strs=stop_strs)
    return ParsedRequest(job, stream, include_usage)


def parse_completion(body: dict, limits: ModelLimits) -> ParsedRequest:
    """POST /v1/completions."""
    _check_model(body, limits)
    n = _int(body, "n", 1, 1, limits.cfg.max_n)
    # OpenAI's completions default: 16 tokens
    return _parse(body, _prompts(body.get("prompt"), n, limits), n, limits, limits.cfg.default_max_tokens)


def parse_chat(body: dict, limits: ModelLimits) -> ParsedRequest:
    """POST /v1/chat/completions."""
    _check_model(body, limits)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise bad_request("'messages' must be a non-empty list of {role, content} objects", "messages",
                          "invalid_type")
    n = _int(body, "n", 1, 1, limits.cfg.max_n)
    _check_rows(1, n, limits)
    try:
        ids = limits.codec.chat_prompt(messages)
    except TextUnavailableError as e:
        raise _text_error(e) from None
    _check_ids(ids, "messages", limits)
    # OpenAI's chat default: until a stop or the end of the context (here: at most the server's --max-tokens)
    return _parse(body, [ids], n, limits, limits.context)
