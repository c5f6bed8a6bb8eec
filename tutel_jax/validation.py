"""Argument checks shared by the layer's entry points (`make_config`, `moe_apply`, the parallel paths) and by the
checkpoint readers (config.json fields, untrusted JSON), so that each rule and its error message lives in one
place.

Untrusted input (a downloaded checkpoint's config.json, index or safetensors header) is checked before anything
is sized from it: `Field` / `check_fields` type- and range-check a JSON object's keys in one pass and report
every problem at once; `load_json` parses bounded, duplicate-free JSON without recursion blow-up.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["check_capacity_factor", "check_input", "is_int", "is_real", "check_int", "check_choice", "Field", "check_fields",
           "raise_problems", "json_nesting_depth", "load_json", "MAX_JSON_DEPTH"]


def check_capacity_factor(value: Any, name: str = "capacity_factor") -> float:
    """`value` as a float, or ValueError naming `name`: a capacity factor is a finite real number.

    Python and NumPy ints and floats pass; bools (`True` would silently mean 1.0), strings (even '1.5'), None,
    arrays and non-finite values do not. The sign keeps Tutel's meaning: > 0 fixed, 0 dropless, < 0 bounded.
    """
    ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    if ok:
        value = float(value)
        ok = math.isfinite(value)
    if not ok:
        raise ValueError(f"{name} must be a finite number (int or float; > 0 fixed capacity, 0 dropless, < 0 "
                         f"bounded dropless), got {value!r}")
    return value


def check_input(x: Any, model_dim: int, *, min_ndim: int = 1, valid: Any = None) -> None:
    """Raises unless `x` is the layer's input: a floating-point array [..., model_dim] with >= `min_ndim` axes,
    and `valid` (a padding mask) None or of x's shape without its last axis.

    TypeError for a non-floating dtype (an integer or bool input would be cast to the compute dtype silently,
    e.g. token ids instead of their embeddings); ValueError for a wrong shape.
    """
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"x must have a floating dtype (float32, bfloat16, float16, ...), got "
                        f"{'no dtype: ' + type(x).__name__ if dtype is None else jnp.dtype(dtype).name}")
    if x.ndim < min_ndim or x.shape[-1] != model_dim:
        layout = (f"[..., model_dim={model_dim}]" if min_ndim <= 1
                  else f"[B, ..., model_dim={model_dim}] with a leading token-batch axis")
        raise ValueError(f"x must have shape {layout}, got {tuple(x.shape)}")
    if valid is not None and tuple(valid.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"valid must have shape {tuple(x.shape[:-1])} (x without its last axis), got "
                         f"{tuple(valid.shape)}")


# --------------------------------------------------------------------------------------------------------------
# Untrusted JSON: integers, reals, config fields
# --------------------------------------------------------------------------------------------------------------


def is_int(value: Any) -> bool:
    """Whether `value` is an integer (Python or NumPy), bools excluded (`true` is no layer count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def is_real(value: Any) -> bool:
    """Whether `value` is a finite real number (int or float, Python or NumPy), bools excluded."""
    return (isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
            and math.isfinite(float(value)))


def check_int(value: Any, name: str, *, minimum: int | None = None, maximum: int | None = None,
              optional: bool = False) -> int | None:
    """`value` as an int, or ValueError naming `name` ("top_k must be an integer >= 1, got 0"): an integer (Python
    or NumPy; not bool, str, float) in [minimum, maximum] (either bound optional); None passes when `optional`."""
    if value is None and optional:
        return None
    problem = _int_problem(value, minimum, maximum)
    if problem:
        raise ValueError(f"{name} {problem}" + (" (or None)" if optional else ""))
    return int(value)


def check_choice(value: Any, name: str, choices: Sequence, *, optional: bool = False) -> Any:
    """`value`, or ValueError naming `name` ("dense_impl must be one of ('auto', 'xla'), got 'fast'") unless it is
    one of `choices` (a bool never is: `True == 1`); None passes when `optional`."""
    if value is None and optional:
        return None
    if isinstance(value, (bool, np.bool_)) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}" + (" or None" if optional else "") + f", got {value!r}")
    return value


def _range_text(minimum: float | None, maximum: float | None, exclusive_min: bool = False) -> str:
    if minimum is not None and maximum is not None:
        return f" in ({minimum}, {maximum}]" if exclusive_min else f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" > {minimum}" if exclusive_min else f" >= {minimum}"
    return "" if maximum is None else f" <= {maximum}"


def _int_problem(value: Any, minimum: int | None, maximum: int | None) -> str | None:
    """What is wrong with `value` as an integer in [minimum, maximum], or None."""
    ok = is_int(value) and (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
    return None if ok else f"must be an integer{_range_text(minimum, maximum)}, got {value!r:.80}"


def _real_problem(value: Any, minimum: float | None, maximum: float | None, exclusive_min: bool) -> str | None:
    """What is wrong with `value` as a finite real in [minimum, maximum] ((minimum, maximum] if exclusive)."""
    ok = is_real(value)
    if ok and minimum is not None:
        ok = value > minimum if exclusive_min else value >= minimum
    if ok and maximum is not None:
        ok = value <= maximum
    return None if ok else (f"must be a finite number{_range_text(minimum, maximum, exclusive_min)}, "
                            f"got {value!r:.80}")


#: the kinds of value a `Field` may require
FIELD_KINDS = ("int", "real", "bool", "str", "int_list", "str_list", "object")


@dataclasses.dataclass(frozen=True)
class Field:
    """One key of a JSON object (e.g. config.json) and what its value must be.

    kind: 'int' (integer, not bool), 'real' (finite int or float, not bool), 'bool', 'str', 'int_list' (a
      list of integers, each in [minimum, maximum]), 'str_list', 'object' (a JSON object).
    required: the key must be present and not null; otherwise absent or null (HF writes null for unset
      options) means "use the default" and is not checked further ...
    nullable: ... unless nullable is False: then null is refused (for keys the loaders read as
      `config.get(key, default)`, where null would not mean the default but break or flip it).
    minimum / maximum: inclusive bounds of an int, real or int_list element; exclusive_min makes the minimum
      exclusive (e.g. rms_norm_eps > 0).
    choices: the allowed values of a 'str' field (None: any string).
    """

    key: str
    kind: str
    required: bool = False
    nullable: bool = True
    minimum: float | None = None
    maximum: float | None = None
    exclusive_min: bool = False
    choices: tuple[str, ...] | None = None

    def problem(self, value: Any) -> str | None:
        """What is wrong with `value` (present, not null) for this field, or None."""
        if self.kind == "int":
            return _int_problem(value, self.minimum, self.maximum)
        if self.kind == "real":
            return _real_problem(value, self.minimum, self.maximum, self.exclusive_min)
        if self.kind == "bool":
            return None if isinstance(value, bool) else f"must be true or false, got {value!r:.80}"
        if self.kind == "str":
            if not isinstance(value, str):
                return f"must be a string, got {value!r:.80}"
            if self.choices is not None and value not in self.choices:
                return f"must be one of {list(self.choices)}, got {value!r:.80}"
            return None
        if self.kind == "object":
            return None if isinstance(value, Mapping) else f"must be an object, got {type(value).__name__}"
        if self.kind in ("int_list", "str_list"):
            if not isinstance(value, list):
                return f"must be a list, got {type(value).__name__}"
            for i, item in enumerate(value):
                bad = (_int_problem(item, self.minimum, self.maximum) if self.kind == "int_list"
                       else None if isinstance(item, str) else f"must be a string, got {item!r:.80}")
                if bad:
                    return f"item {i} {bad}"
            return None
        raise ValueError(f"Field {self.key!r}: unknown kind {self.kind!r} (known: {FIELD_KINDS})")


def check_fields(mapping: Mapping[str, Any], fields: Sequence[Field], prefix: str = "") -> list[str]:
    """Every problem of `mapping` against `fields`, as 'key: what is wrong' strings (empty: all fine).

    Nothing is raised here, so that one pass can collect the problems of several groups of fields (a config's
    common keys, its family's keys, cross-field rules) and `raise_problems` reports them together. `prefix`
    is put before each key (e.g. 'rope_parameters.').
    """
    problems = []
    for field in fields:
        value = mapping.get(field.key)
        if value is None:
            if field.key not in mapping and field.required:
                problems.append(f"{prefix}{field.key}: missing (required)")
            elif field.key in mapping and (field.required or not field.nullable):
                problems.append(f"{prefix}{field.key}: must not be null"
                                + ("" if field.required else " (omit it for the default)"))
            continue
        bad = field.problem(value)
        if bad:
            problems.append(f"{prefix}{field.key}: {bad}")
    return problems


def raise_problems(where: str, problems: Sequence[str]) -> None:
    """ValueError '<where>: <problem>; <problem>; ...' when there are problems (one error for all of them)."""
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))


#: nesting deeper than this is refused before parsing (config.json and the safetensors headers nest <= 5)
MAX_JSON_DEPTH = 64
# JSON string literals (escapes included): their brackets are text, not nesting
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = np.zeros(256, np.int8)
_DEPTH_STEP[list(b"[{")] = 1
_DEPTH_STEP[list(b"]}")] = -1
_DEPTH_CHUNK = 1 << 16  # brackets summed at a time (int64 running depths: 512 KiB)


def json_nesting_depth(data: bytes, limit: int = MAX_JSON_DEPTH) -> int:
    """How deeply `data` (JSON text) nests arrays and objects, counted without parsing (no recursion): string
    literals are dropped, then the brackets are summed in chunks. Stops early once past `limit` (the
    value returned then is > limit, not necessarily the maximum)."""
    brackets = _JSON_STRING.sub(b'""', data).translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for start in range(0, len(brackets), _DEPTH_CHUNK):
        steps = _DEPTH_STEP[np.frombuffer(brackets, np.uint8, min(_DEPTH_CHUNK, len(brackets) - start), start)]
        levels = np.cumsum(steps, dtype=np.int64) + depth
        deepest, depth = max(deepest, int(levels.max())), int(levels[-1])
        if deepest > limit:
            break
    return deepest


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """object_pairs_hook refusing a key twice in one object (json keeps the last one silently)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {twice!r:.200} occurs twice in one object")
    return out


def load_json(data: bytes | str, where: str, *, max_bytes: int | None = None,
              max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parses untrusted JSON text: ValueError naming `where` for text over `max_bytes`, nesting deeper than
    `max_depth` (checked before parsing: a deeply nested file is an error, never a RecursionError), invalid
    UTF-8 or JSON, and a key that occurs twice in one object (which plain json.loads silently resolves)."""
    raw = data.encode("utf-8") if isinstance(data, str) else data if isinstance(data, bytes) else bytes(data)
    if max_bytes is not None and len(raw) > max_bytes:
        raise ValueError(f"{where}: {len(raw)} bytes of JSON exceed the {max_bytes}-byte limit")
    if json_nesting_depth(raw, max_depth) > max_depth:
        raise ValueError(f"{where}: JSON nested deeper than {max_depth} levels")
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not valid UTF-8 ({e})") from None
    except RecursionError:  # not reached after the depth check; kept so that no parse can raise it
        raise ValueError(f"{where}: JSON nested too deeply") from None
    except ValueError as e:  # json.JSONDecodeError and _unique_keys' error
        raise ValueError(f"{where}: not valid JSON ({e})") from None
