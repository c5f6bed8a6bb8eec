"""Sampling parameters, checked once for every way of generating: `generate`, `ContinuousBatcher.add`,
`tutel-jax generate` (its argparse types) and the OpenAI-compatible server (which answers 400 with the error's
`param` and `code`).

    params = check_sampling(max_new_tokens=32, temperature=0.8, top_k=50, top_p=0.95,
                            prompt_length=12, context=model_context(model))

The rules (a `SamplingParamError`, a ValueError naming the parameter, the value and the allowed range):
  temperature      a finite number >= 0 (0: greedy; the server also caps it, at 2 like OpenAI);
  top_p            None or a number in (0, 1] (None or 1: off);
  top_k            None or an integer >= 0 (None or 0: off);
  max_new_tokens   an integer >= 1 (the server also caps it), and prompt length + max_new_tokens must not exceed
                   the model's context (its max_position_embeddings) when both are known;
  logit_bias       None or a mapping of at most MAX_LOGIT_BIAS token ids (ints, or decimal strings as JSON object
                   keys are) in [0, vocab) to biases in [-100, 100], added to the logits before sampling (greedy
                   included): +100 all but forces a token, -100 all but bans it (`check_logit_bias`).

Generation that meets non-finite logits stops with a `NonFiniteLogitsError` (a FloatingPointError).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["MAX_LOGIT_BIAS", "NonFiniteLogitsError", "SamplingParamError", "SamplingParams", "check_logit_bias",
           "check_max_new_tokens", "check_sampling", "logit_bias_arrays", "check_temperature", "check_top_k", "check_top_p", "model_context"]

CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")
MAX_LOGIT_BIAS = 300  # token ids one request may bias (the engines' fixed bias width: one compile)
MAX_BIAS = 100.0
_DECIMAL = re.compile(r"0|[1-9][0-9]{0,9}")


class SamplingParamError(ValueError):
    """A sampling parameter outside its range: `param` names it, `code` is 'invalid_value', 'invalid_type' or
    'context_length_exceeded' (the server's error codes)."""

    def __init__(self, message: str, param: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


class NonFiniteLogitsError(FloatingPointError):
    """The model produced NaN or inf logits at generation step `step` (0: the prefill), in batch rows `rows`
    (None: the one request concerned)."""

    def __init__(self, step: int, rows: list[int] | None = None):
        where = "" if rows is None else f" in batch row{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows))}"
        super().__init__(f"non-finite logits at step {step}{where}: the model produced NaN or inf (check the "
                         f"checkpoint's weights and the dtype)")
        self.step, self.rows = step, rows


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Checked sampling parameters (see `check_sampling`)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float, np.integer, np.floating))) and not isinstance(v, (bool, np.bool_))


def _show(v: Any) -> str:
    return repr(v.item() if isinstance(v, np.generic) else v)


def _type_error(name: str, kind: str, v: Any) -> SamplingParamError:
    return SamplingParamError(f"{name} must be {kind}, got {type(v).__name__} {_show(v)}", name, "invalid_type")


def check_temperature(value: Any, *, maximum: float | None = None, name: str = "temperature") -> float:
    """`value` as a float: a finite number >= 0 (and <= maximum when given); 0 means greedy."""
    if not _is_number(value):
        raise _type_error(name, "a number", value)
    v = float(value)
    if not math.isfinite(v) or v < 0 or (maximum is not None and v > maximum):
        allowed = ">= 0" if maximum is None else f"in [0, {maximum:g}]"
        raise SamplingParamError(f"{name} must be a finite number {allowed} (0: greedy), got {_show(value)}", name)
    return v


def check_top_p(value: Any, *, name: str = "top_p") -> float | None:
    """None, or `value` as a float in (0, 1] (None or 1: no nucleus restriction)."""
    if value is None:
        return None
    if not _is_number(value):
        raise _type_error(name, "a number", value)
    v = float(value)
    if not 0.0 < v <= 1.0:  # NaN fails too
        raise SamplingParamError(f"{name} must be a number in (0, 1] (1 or None: off), got {_show(value)}", name)
    return v


def check_top_k(value: Any, *, name: str = "top_k") -> int | None:
    """None, or `value` as an int >= 0 (None or 0: no top-k restriction)."""
    if value is None:
        return None
    if not _is_int(value):
        raise _type_error(name, "an integer >= 0 (0 or None: off)", value)
    if value < 0:
        raise SamplingParamError(f"{name} must be an integer >= 0 (0 or None: off), got {_show(value)}", name)
    return int(value)


def check_max_new_tokens(value: Any, *, prompt_length: int | None = None, context: int | None = None,
                         maximum: int | None = None, name: str = "max_new_tokens") -> int:
    """`value` as an int >= 1 (and <= maximum when given); prompt_length + value must fit `context` when both
    are given."""
    allowed = ">= 1" if maximum is None else f"in [1, {maximum}]"
    if not _is_int(value):
        raise _type_error(name, f"an integer {allowed}", value)
    v = int(value)
    if v < 1 or (maximum is not None and v > maximum):
        raise SamplingParamError(f"{name} must be an integer {allowed}, got {_show(value)}", name)
    if prompt_length is not None and context is not None and prompt_length + v > context:
        raise SamplingParamError(f"prompt ({prompt_length} tokens) + {name} ({v}) = {prompt_length + v} exceeds the "
                                 f"model's context of {context} tokens", name, "context_length_exceeded")
    return v


def check_sampling(max_new_tokens: Any, temperature: Any = 0.0, top_k: Any = None, top_p: Any = None, *,
                   prompt_length: int | None = None, context: int | None = None,
                   max_temperature: float | None = None, max_new_tokens_limit: int | None = None,
                   names: Mapping[str, str] | None = None) -> SamplingParams:
    """Checks every sampling parameter (the rules in the module docstring) and returns them normalized
    (Python int / float). `prompt_length` (the longest prompt's real tokens) and `context` (the model's
    positions, `model_context`) check that the completion fits; `max_temperature` and `max_new_tokens_limit`
    are extra caps (the server's); `names` renames parameters in the messages (e.g. max_new_tokens ->
    max_tokens). Raises SamplingParamError."""
    names = dict(names or {})
    return SamplingParams(
        max_new_tokens=check_max_new_tokens(max_new_tokens, prompt_length=prompt_length, context=context,
                                            maximum=max_new_tokens_limit,
                                            name=names.get("max_new_tokens", "max_new_tokens")),
        temperature=check_temperature(temperature, maximum=max_temperature,
                                      name=names.get("temperature", "temperature")),
        top_k=check_top_k(top_k, name=names.get("top_k", "top_k")),
        top_p=check_top_p(top_p, name=names.get("top_p", "top_p")))


def check_logit_bias(value: Any, vocab: int | None = None, *, name: str = "logit_bias") -> dict[int, float]:
    """`value` as {token id: bias}: None -> {}; else a mapping of at most MAX_LOGIT_BIAS token ids (ints, or
    canonical decimal strings such as JSON object keys) in [0, vocab) to finite numbers in [-100, 100]."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _type_error(name, "an object mapping token ids to biases", value)
    if len(value) > MAX_LOGIT_BIAS:
        raise SamplingParamError(f"{name} may bias at most {MAX_LOGIT_BIAS} tokens, got {len(value)}", name)
    out: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, str) and _DECIMAL.fullmatch(key):
            tid = int(key)
        elif _is_int(key):
            tid = int(key)
        else:
            raise SamplingParamError(f"{name} keys must be token ids (non-negative integers), got {key!r}", name,
                                     "invalid_type")
        if tid < 0 or (vocab is not None and tid >= vocab):
            limit = f"[0, {vocab})" if vocab is not None else ">= 0"
            raise SamplingParamError(f"{name}: token id {tid} is outside the vocabulary {limit}", name)
        if not _is_number(bias):
            raise SamplingParamError(f"{name}[{key!r}] must be a number in [-100, 100], got {type(bias).__name__} "
                                     f"{_show(bias)}", name, "invalid_type")
        if not -MAX_BIAS <= float(bias) <= MAX_BIAS:  # NaN fails too
            raise SamplingParamError(f"{name}[{key!r}] must be a number in [-100, 100], got {_show(bias)}", name)
        if tid in out:
            raise SamplingParamError(f"{name} names token id {tid} twice", name)
        out[tid] = float(bias)
    return out


def logit_bias_arrays(bias: Mapping[int, float] | Any, width: int = MAX_LOGIT_BIAS) -> tuple[np.ndarray, np.ndarray]:
    """(ids [width] int32, biases [width] float32) of a checked logit_bias (unused entries: id 0, bias 0), the
    engines' fixed-width form: logits.at[ids].add(biases) applies it."""
    items = sorted(dict(bias).items())
    ids, vals = np.zeros(width, np.int32), np.zeros(width, np.float32)
    ids[:len(items)] = [t for t, _ in items]
    vals[:len(items)] = [b for _, b in items]
    return ids, vals


def model_context(model_or_config: Any) -> int | None:
    """The positions a model supports (its config's max_position_embeddings or an equivalent key), from a model
    with a `.config` dict or from the dict itself; None when it does not say."""
    config = model_or_config if isinstance(model_or_config, Mapping) else getattr(model_or_config, "config", None)
    if not isinstance(config, Mapping):
        return None
    for key in CONTEXT_KEYS:
        v = config.get(key)
        if _is_int(v) and v > 0:
            return int(v)
    return None
