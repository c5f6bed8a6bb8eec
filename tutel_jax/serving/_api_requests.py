"""Request validation, one schema per endpoint: a JSON body becomes a `ParsedRequest` (the engine's `Job` plus
the response options) or an `APIError` naming the field at fault (400; 404 for another model's name).

- `parse_body`: the raw body as a JSON object (invalid, truncated or too deeply nested JSON: 400 invalid_json;
  bytes that are not UTF-8 or a lone UTF-16 surrogate such as "\\ud800" in a string: 400 naming the field;
  values nested more than MAX_JSON_DEPTH levels: 400 naming the top-level field).
- `parse_completion`: POST /v1/completions (`prompt`: a string, a list of strings, a token-id list, or a list of
  token-id lists; a string prompt is the client's raw text, its special tokens' text parsed).
- `parse_chat`: POST /v1/chat/completions (`messages`: objects with a `role` among system, developer, user,
  assistant and tool, `content` a string, null or text parts, optional `name`, `tool_calls`, `tool_call_id`;
  `tools` goes to the chat template as its `tools` variable; without max_tokens it generates until a stop, the
  context's end or the server's --max-tokens). The request's text never becomes a control token (see
  `TextCodec.chat_prompt`); a template that fails or refuses the conversation is a 400 on `messages`.
Both share the sampling fields (`check_sampling`'s rules with the OpenAI caps: temperature in [0, 2], top_p 0 as
greedy, max_tokens at most the server's limit), `logit_bias` (token id -> bias in [-100, 100], added to the logits
before sampling, greedy included), `n`, `seed`, `stop`, `stop_token_ids`, `stream`, `stream_options` and `user`
(an end-user id; nothing depends on it). Every other field is refused with a 400 naming it (code
'unsupported_parameter'), except OpenAI fields this server does not implement given at the value that turns
them off (`NEUTRAL`, e.g. `logprobs: false`, `echo: false`, `best_of: 1`, `presence_penalty: 0`). A request's
prompts x n must fit the server's batch (checked before any prompt is tokenized)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
from collections.abc import Callable
from typing import Any

from ._api_errors import APIError, bad_request
from ._engines import Job
from ._sampling import SamplingParamError, check_logit_bias, check_sampling
from ._server_config import ServerConfig
from ._tokenizer import ChatTemplateError, TextCodec, TextUnavailableError

__all__ = ["CHAT_FIELDS", "COMPLETION_FIELDS", "MAX_JSON_DEPTH", "MAX_TEMPERATURE", "NEUTRAL", "ROLES", "ModelLimits",
           "ParsedRequest", "parse_body", "parse_chat", "parse_completion"]

MAX_TEMPERATURE = 2.0  # the OpenAI API's cap
MAX_STOP_SEQUENCES = 16
MAX_JSON_DEPTH = 64  # tool schemas nest a few levels; nothing a request needs nests deeper
INT32_MAX = 2 ** 31 - 1

ROLES = ("system", "developer", "user", "assistant", "tool")  # the OpenAI chat roles
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})
_SHARED = frozenset({"model", "max_tokens", "temperature", "top_p", "n", "seed", "stop", "stop_token_ids", "stream",
                     "stream_options", "logit_bias", "user"})
COMPLETION_FIELDS = _SHARED | {"prompt"}
CHAT_FIELDS = _SHARED | {"messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls"}


def _is_zero(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0)


# OpenAI fields this server does not implement: accepted only at the value that means "off" (what some clients
# send by default); any other value is a 400 naming the field
NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "logprobs": (lambda v: v is None or v is False, "null or false"),
    "top_logprobs": (_is_zero, "null or 0"),
    "echo": (lambda v: v is None or v is False, "null or false"),
    "best_of": (lambda v: v is None or (v == 1 and not isinstance(v, bool)), "null or 1"),
    "suffix": (lambda v: v is None or v == "", "null or empty"),
    "presence_penalty": (_is_zero, "null or 0"),
    "frequency_penalty": (_is_zero, "null or 0"),
    "response_format": (lambda v: v is None or v == {"type": "text"}, 'null or {"type": "text"}'),
}


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
    """The request body as a JSON object whose strings are all valid Unicode, nested at most MAX_JSON_DEPTH
    levels."""
    # bytes that are not UTF-8 become lone surrogates here, so the check below names the field holding them
    text = raw.decode("utf-8", "surrogateescape") if isinstance(raw, (bytes, bytearray)) else raw
    try:
        body = json.loads(text)
    except RecursionError:  # the C scanner's guard: no deep recursion happens here or later
        raise APIError(400, "request body is not valid JSON: nested too deeply", code="invalid_json") from None
    except ValueError as e:
        message = " ".join(str(e).encode("utf-8", "backslashreplace").decode().split())
        raise APIError(400, f"request body is not valid JSON: {message}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    _check_values(body)
    return body


def _check_values(body: dict) -> None:
    """400 naming the field for a string (or key) that is not valid Unicode (a lone surrogate: from "\\ud800"
    in the JSON or from bytes that are not UTF-8) and for a field nested more than MAX_JSON_DEPTH levels."""
    stack: list[tuple[Any, str, int]] = [(v, str(k), 1) for k, v in body.items()]
    for k in body:
        _check_unicode(k, "a field name")
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            top = path.split(".")[0].split("[")[0]
            raise bad_request(f"'{top}' is nested more than {MAX_JSON_DEPTH} levels deep", top)
        if isinstance(value, str):
            _check_unicode(value, path)
        elif isinstance(value, dict):
            for k, v in value.items():
                _check_unicode(k, f"a key of {path}")
                stack.append((v, f"{path}.{k}", depth + 1))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))


def _check_unicode(s: str, path: str) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        param = path.removeprefix("a key of ").removeprefix("a field name")
        raise bad_request(f"{path} is not valid text: character {e.start} is a lone UTF-16 surrogate or a byte "
                          "that is not UTF-8", param or None, "invalid_encoding") from None


def _check_fields(body: dict, known: frozenset[str]) -> None:
    """400 naming the first field this endpoint does not act on (see NEUTRAL for those accepted when off)."""
    for name, value in body.items():
        if name in known:
            continue
        if name in NEUTRAL:
            ok, off = NEUTRAL[name]
            if ok(value):
                continue
            raise bad_request(f"'{name}' is not supported by this server (only {off} is accepted)", name,
                              "unsupported_parameter")
        raise bad_request(f"'{name}' is not a parameter this server supports", name, "unsupported_parameter")


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
    vocab = limits.vocab if limits.vocab is not None else INT32_MAX + 1  # ids become int32 arrays
    if any(t < 0 or t >= vocab for t in p):
        raise bad_request(f"token ids must be in [0, {vocab})", param)
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
    stop_ids, stop_strs = _stop(body, limits)
    try:
        bias = check_logit_bias(body.get("logit_bias"), limits.vocab)
    except SamplingParamError as e:
        raise bad_request(str(e), e.param, e.code) from None
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("'user' must be a string", "user", "invalid_type")
    job = Job(prompts=prompts, n=n, max_tokens=params.max_new_tokens, temperature=temperature,
              top_p=None if top_p is None or top_p >= 1.0 else top_p, seed=seed,
              future=concurrent.futures.Future(), stop_ids=stop_ids, stop_strs=stop_strs,
              logit_bias=tuple(sorted(bias.items())))
    return ParsedRequest(job, stream, include_usage)


def parse_completion(body: dict, limits: ModelLimits) -> ParsedRequest:
    """POST /v1/completions."""
    _check_fields(body, COMPLETION_FIELDS)
    _check_model(body, limits)
    n = _int(body, "n", 1, 1, limits.cfg.max_n)
    # OpenAI's completions default: 16 tokens
    return _parse(body, _prompts(body.get("prompt"), n, limits), n, limits, limits.cfg.default_max_tokens)


def _check_messages(messages: Any) -> None:
    """400 naming the message (and field) that is not a chat message this server takes."""
    if not isinstance(messages, list) or not messages:
        code = "missing_required_parameter" if messages is None else "invalid_type"
        raise bad_request("'messages' must be a non-empty list of {role, content} objects", "messages", code)
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object with a role and a content", where, "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            shown = repr(role) if isinstance(role, str) and len(role) <= 40 else type(role).__name__
            raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}, got {shown}", f"{where}.role",
                              "invalid_value" if isinstance(role, str) else "invalid_type")
        for name in m:
            if name not in MESSAGE_FIELDS:
                raise bad_request(f"{where}.{name} is not a message field this server supports (fields: "
                                  f"{', '.join(sorted(MESSAGE_FIELDS))})", f"{where}.{name}", "unsupported_parameter")
        for name in ("name", "tool_call_id"):
            if m.get(name) is not None and not isinstance(m[name], str):
                raise bad_request(f"{where}.{name} must be a string", f"{where}.{name}", "invalid_type")
        if m.get("tool_calls") is not None and not isinstance(m["tool_calls"], list):
            raise bad_request(f"{where}.tool_calls must be a list", f"{where}.tool_calls", "invalid_type")


def _tools(body: dict) -> list | None:
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise bad_request("'tools' must be a list of tool objects", "tools", "invalid_type")
    choice = body.get("tool_choice")
    if choice not in (None, "none", "auto"):
        raise bad_request("'tool_choice' must be \"none\" or \"auto\": this server does not force tool calls",
                          "tool_choice", "unsupported_parameter")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls", "invalid_type")
    return tools or None


def parse_chat(body: dict, limits: ModelLimits) -> ParsedRequest:
    """POST /v1/chat/completions."""
    _check_fields(body, CHAT_FIELDS)
    _check_model(body, limits)
    messages = body.get("messages")
    _check_messages(messages)
    tools = _tools(body)
    n = _int(body, "n", 1, 1, limits.cfg.max_n)
    _check_rows(1, n, limits)
    try:
        ids = limits.codec.chat_prompt(messages, tools)
    except TextUnavailableError as e:
        raise _text_error(e) from None
    except ChatTemplateError as e:  # the template refused these messages or broke a sandbox rule / limit
        raise bad_request(str(e), "messages", "chat_template_error") from None
    _check_ids(ids, "messages", limits)
    # OpenAI's chat default: until a stop or the end of the context (here: at most the server's --max-tokens)
    return _parse(body, [ids], n, limits, limits.context)
