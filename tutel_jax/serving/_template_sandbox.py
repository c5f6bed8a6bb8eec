"""The chat-template sandbox (`chat_template`'s compiler and renderer, the module that needs jinja2): jinja2's
`ImmutableSandboxedEnvironment` with a guarded code generator, the load-time static check and each render's
budget of characters, loop iterations and time (see `chat_template`'s docstring for the rules)."""

from __future__ import annotations

import contextvars
import dataclasses
import datetime
import functools
import json
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension
from jinja2.runtime import Namespace
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from ._chat_template import ChatTemplateError, TemplateLimits

__all__ = ["SandboxedTemplate", "compile_template", "static_check"]


@dataclasses.dataclass
class _Budget:
    """The running render's limits (one per render, in a context variable: renders never share it)."""
    limits: TemplateLimits
    deadline: float
    iterations: int = 0


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("chat_template_budget", default=None)

# str methods whose int arguments set the result's width
_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})
_DIGITS = re.compile(r"\d+")


def _budget() -> _Budget | None:
    """The running render's budget after checking its deadline (None outside a render: compiling)."""
    b = _BUDGET.get()
    if b is not None and time.monotonic() > b.deadline:
        _refuse(f"rendering took longer than {b.limits.timeout_s:g} s")
    return b


def _refuse(message: str):
    raise SecurityError(message)


def _text_size(value: Any, budget: int) -> int:
    """An upper estimate of len(str(value)) for the values a template handles (strings, numbers, lists, tuples,
    dicts, namespaces), computed without building the string; it stops counting once past `budget` (a list of
    many references to one long string is counted per reference)."""
    total, stack = 0, [value]
    while stack and total <= budget:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v) + 2  # repr quotes inside a container
        elif isinstance(v, bool) or v is None:
            total += 5
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 2
        elif isinstance(v, float):
            total += 25
        elif isinstance(v, Mapping):
            total += 2 + 2 * len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(v)
            stack.extend(v)
        elif isinstance(v, Namespace):
            stack.append(dict(object.__getattribute__(v, "_Namespace__attrs")))
        else:  # loop contexts, macros, undefined, cyclers: a short repr
            total += 64
    return total


def _check_size(value: Any, what: str = "a value") -> Any:
    """`value` when its length (a string, list, tuple or dict) fits the render's max_chars."""
    b = _budget()
    if b is not None and isinstance(value, (str, list, tuple, dict)) and len(value) > b.limits.max_chars:
        _refuse(f"{what} of {len(value)} items exceeds the limit of {b.limits.max_chars} characters")
    return value


def _check_text(value: Any, what: str, times: int = 1, extra: int = 0) -> None:
    """Refuses `value` when `times` copies of its text (see `_text_size`) plus `extra` characters would exceed
    max_chars (checked before the text is built)."""
    b = _budget()
    if b is None:
        return
    limit = b.limits.max_chars
    if extra > limit or times * _text_size(value, (limit - extra) // max(times, 1) + 1) + extra > limit:
        _refuse(f"{what} would exceed the limit of {limit} characters")


def _check_width(n: Any, what: str) -> None:
    b = _budget()
    if b is not None and isinstance(n, int) and not isinstance(n, bool) and n > b.limits.max_chars:
        _refuse(f"{what} {n} exceeds the limit of {b.limits.max_chars} characters")


def _check_format(fmt: str, args: Any, what: str) -> None:
    """A %- or {}-format's widths and precisions (all its numbers) and its arguments' text must fit max_chars."""
    b = _budget()
    if b is None:
        return
    widths = sum(int(d) if len(d) < 12 else b.limits.max_chars + 1 for d in _DIGITS.findall(fmt))
    if widths + len(fmt) > b.limits.max_chars:
        _refuse(f"{what}: the format's widths exceed the limit of {b.limits.max_chars} characters")
    _check_text(args, what)


def _check_replace(s: Any, old: Any, new: Any, count: Any = -1) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        hits = len(s) + 1 if not old else s.count(old)
        if isinstance(count, int) and count >= 0:
            hits = min(hits, count)
        b = _budget()
        if b is not None and len(s) + hits * max(len(new) - len(old), 0) > b.limits.max_chars:
            _refuse(f"replace would exceed the limit of {b.limits.max_chars} characters")


# filters that can build far more than their input: checked before they run
def _pre_filter(name: str, args: tuple, kwargs: dict) -> None:
    value = args[0] if args else None
    if name in ("join", "string", "tojson", "list", "format"):
        indent = kwargs.get("indent", args[2] if name == "tojson" and len(args) > 2 else None)
        # json.dumps with an indent writes up to `indent` spaces per item and nesting level
        scale = 1 + (indent if isinstance(indent, int) and indent > 0 else 0)
        _check_width(scale, "tojson indent")
        _check_text([value, args[1:], list(kwargs.values())], f"|{name}", times=scale)
        if name == "join" and isinstance(value, (list, tuple)) and len(args) > 1 and isinstance(args[1], str):
            _check_text(value, "|join", extra=len(args[1]) * len(value))
        if name == "format" and isinstance(value, str):
            _check_format(value, args[1:], "|format")
    elif name == "indent" and isinstance(value, str):
        width = kwargs.get("width", args[1] if len(args) > 1 else 4)
        width = len(width) if isinstance(width, str) else width
        _check_width(width, "indent width")
        b = _budget()
        if b is not None and isinstance(width, int) and len(value) + width * (value.count("\n") + 1) > \
                b.limits.max_chars:
            _refuse(f"|indent would exceed the limit of {b.limits.max_chars} characters")
    elif name == "replace":
        _check_replace(*args[:4])
    else:
        for v in (*args[1:], *kwargs.values()):
            _check_width(v, f"|{name} argument")


def _guard_filter(name: str, func: Any) -> Any:
    """`func` with the render's checks around it (its jinja pass_context / pass_environment marks kept)."""
    @functools.wraps(func)
    def guarded(*args, **kwargs):
        # pass_context / pass_eval_context / pass_environment filters get that object first
        values = args[1:] if getattr(func, "jinja_pass_arg", None) is not None else args
        _pre_filter(name, values, kwargs)
        return _check_size(func(*args, **kwargs), f"the result of |{name}")
    return guarded


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' `tojson`: plain `json.dumps` (no HTML escaping, non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    if not isinstance(fmt, str) or len(fmt) > 256:
        _refuse("strftime_now needs a format string of at most 256 characters")
    return datetime.datetime.now().strftime(fmt)


class TemplateRaised(jinja2.TemplateError):
    """raise_exception(message) in a template: the template refuses the conversation."""

class GuardedCodeGenerator(CodeGenerator):
    """Compiles every for loop's iterable through `environment.guard_loop` and every `~` through
    `environment.join_text` (both checked); the rest as jinja2 does."""

    def visit_For(self, node, frame):
        # the iterable becomes environment.guard_loop(iterable): each item counted and timed
        guarded = nodes.Call(nodes.EnvironmentAttribute("guard_loop", lineno=node.lineno), [node.iter], [],
                             None, None, lineno=node.lineno)
        super().visit_For(nodes.For(node.target, guarded, node.body, node.else_, node.test, node.recursive,
                                    lineno=node.lineno), frame)

    def visit_Concat(self, node, frame):
        self.write("environment.join_text((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

class GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks the assistant's tokens with it): its body."""
    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)

class SandboxEnvironment(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with the guarded code generator, the helpers templates expect and every
    operation checked against the running render's budget."""

    code_generator_class = GuardedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%", "//"})

    def __init__(self):
        # optimized=False: no constant folding, which would run filters at load, outside the checks
        super().__init__(trim_blocks=True, lstrip_blocks=True, autoescape=False, finalize=self._finalize,
                         optimized=False,
                         extensions=[jinja2.ext.loopcontrols, GenerationBlock])
        self.globals.pop("lipsum", None)  # a text generator no chat template needs
        self.globals.update(raise_exception=self._raise_exception, strftime_now=_strftime_now)
        self.filters["tojson"] = _tojson
        self.filters = {name: _guard_filter(name, f) for name, f in self.filters.items()}

    @staticmethod
    def _raise_exception(message: Any = "") -> None:
        raise TemplateRaised(str(message))

    @staticmethod
    def _finalize(value: Any) -> Any:
        _check_text(value, "a printed value")  # before str() builds it
        return value

    def concat(self, parts: Iterable[str]) -> str:  # macro bodies and {% set %} blocks
        b, out, total = _budget(), [], 0
        for p in parts:
            total += len(p)
            if b is not None and total > b.limits.max_chars:
                _refuse(f"a block's text exceeds the limit of {b.limits.max_chars} characters")
            out.append(p)
        return "".join(out)

    def join_text(self, parts: tuple) -> str:  # `a ~ b`
        _check_text(parts, "a ~ concatenation")
        return "".join(str(p) for p in parts)

    def guard_loop(self, iterable: Any) -> Iterator[Any]:
        for item in iterable:
            b = _budget()
            if b is not None:
                b.iterations += 1
                if b.iterations > b.limits.max_iterations:
                    _refuse(f"loops ran more than {b.limits.max_iterations} iterations")
            yield item

    def unsafe_undefined(self, obj: Any, attribute: str):
        _refuse(f"access to attribute {attribute!r} of a {type(obj).__name__} object is not allowed")

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        b = _budget()
        limit = b.limits.max_chars if b is not None else None
        if limit is not None:
            if operator == "*":
                seq, n = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > limit:
                    _refuse(f"a repetition of {len(seq)} x {n} exceeds the limit of {limit} characters")
            elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, type(left)):
                if len(left) + len(right) > limit:
                    _refuse(f"a sum of {len(left)} + {len(right)} exceeds the limit of {limit} characters")
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
                if abs(left) > 1 and right * abs(left).bit_length() > 4 * limit:
                    _refuse(f"{left} ** {right} is too large")
            elif operator == "%" and isinstance(left, str):
                _check_format(left, right, "a % format")
        return _check_size(super().call_binop(context, operator, left, right), f"the result of {operator}")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _budget()
        owner = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "")
        if isinstance(owner, str):
            if name in _WIDTH_METHODS:
                for v in (*args, *kwargs.values()):
                    _check_width(v, f"str.{name} width")
            elif name == "join":
                items = len(args[0]) if args and isinstance(args[0], (list, tuple)) else 0
                _check_text(args, "str.join", extra=len(owner) * items)
            elif name == "replace":
                _check_replace(owner, *args[:3])
        return _check_size(super().call(__context, __obj, *args, **kwargs), f"the result of {name or 'a call'}")

    def wrap_str_format(self, value: Any) -> Any:
        fmt = super().wrap_str_format(value)
        if fmt is None:
            return None
        text = value.__self__

        def checked(*args: Any, **kwargs: Any) -> str:
            _check_format(text, [args, kwargs], "str.format")
            return _check_size(fmt(*args, **kwargs), "the result of str.format")
        return checked


def static_check(env: Any, source: str, file: str) -> Any:
    """The parsed template, after refusing what a chat template never needs: attributes starting with `_`, keys
    starting with `__`, and other templates (include / import / extends)."""
    tree = env.parse(source)
    for node in tree.find_all((nodes.Getattr, nodes.Getitem, nodes.Include, nodes.Import, nodes.FromImport,
                               nodes.Extends)):
        if isinstance(node, nodes.Getattr) and node.attr.startswith("_"):
            raise ChatTemplateError(file, f"line {node.lineno}: attribute {node.attr!r} is not allowed "
                                          "(names starting with '_' are internals)")
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and \
                isinstance(node.arg.value, str) and node.arg.value.startswith("__"):
            raise ChatTemplateError(file, f"line {node.lineno}: item {node.arg.value!r} is not allowed "
                                          "(names starting with '__' are internals)")
        if isinstance(node, (nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends)):
            raise ChatTemplateError(file, f"line {node.lineno}: {type(node).__name__.lower()} is not allowed "
                                          "(a chat template must be self-contained)")
    return tree


class SandboxedTemplate:
    """A template compiled in the sandbox; `render(variables)` -> the text, under the template's limits."""

    def __init__(self, template: Any, file: str, limits: TemplateLimits):
        self._template, self.file, self.limits = template, file, limits

    def render(self, variables: Mapping[str, Any]) -> str:
        """The template's text for `variables`; ChatTemplateError (naming the file) when the template refuses
        them (`raise_exception`), breaks a sandbox rule or exceeds a limit."""
        limits = self.limits
        token = _BUDGET.set(_Budget(limits, time.monotonic() + limits.timeout_s))
        try:
            out, total = [], 0
            for chunk in self._template.generate(**variables):
                total += len(chunk)
                if total > limits.max_chars:
                    _refuse(f"its output exceeds the limit of {limits.max_chars} characters")
                _budget()
                out.append(chunk)
            return "".join(out)
        except TemplateRaised as e:
            raise ChatTemplateError(self.file, f"refused the conversation: {e}") from None
        except Exception as e:  # noqa: BLE001 - whatever a template does wrong is the template's failure
            raise ChatTemplateError(self.file, f"rendering failed: {type(e).__name__}: {e}") from None
        finally:
            _BUDGET.reset(token)


def compile_template(source: str, file: str, limits: TemplateLimits) -> SandboxedTemplate:
    """Compiles `source` (the text of the checkpoint file `file`) in the sandbox; ChatTemplateError naming the
    file when it is not valid Jinja or uses what the sandbox refuses at load (`static_check`)."""
    env = SandboxEnvironment()
    # jinja2 folds constant output expressions at compile time: under the same budget, so a check refusing one
    # leaves it to run (and fail) at render
    token = _BUDGET.set(_Budget(limits, time.monotonic() + limits.timeout_s))
    try:
        tree = static_check(env, source, file)
        template = env.from_string(tree)
    except ChatTemplateError:
        raise
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(file, f"is not valid Jinja: line {e.lineno}: {e.message}") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(file, f"is not valid Jinja: {e}") from None
    except RecursionError:
        raise ChatTemplateError(file, "is not valid Jinja: nested too deeply") from None
    finally:
        _BUDGET.reset(token)
    return SandboxedTemplate(template, file, limits)
