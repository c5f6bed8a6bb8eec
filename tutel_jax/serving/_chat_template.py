"""Chat templates from a checkpoint, rendered in a sandbox: nothing a template says can reach the server process.

A checkpoint's chat template (tokenizer_config.json's `chat_template`, or chat_template.jinja) is untrusted code.
It is compiled by jinja2's `ImmutableSandboxedEnvironment`, as Hugging Face transformers does, with the helpers
templates expect: `raise_exception(message)`, `strftime_now(format)`, a `tojson` filter with transformers'
semantics (`json.dumps`, no HTML escaping, `ensure_ascii=False`), the loop controls extension (`break`,
`continue`) and the `{% generation %}` block (rendered as its body). On top of the sandbox:

- at load, `load_chat_template` refuses a template that is not valid Jinja, that names an attribute starting
  with `_` (`__class__`, `__globals__`, `cycler.__init__`, ...) or a `__`-key, or that includes, imports or
  extends other templates;
- at render, an attribute the sandbox refuses raises at once (plain Jinja would render it as an empty string),
  and every step is bounded (`TemplateLimits`): the rendered text, every string, list or dict a template builds
  (by `+`, `*`, `**`, `%`, `~`, a filter, a method call, a macro or `{% set %}` block) and every value printed
  hold at most `max_chars` characters (checked before the value is built where one operation could build far
  more than its operands, e.g. `'a' * 10**10`, `'%999999999d' % 1` or a join of many references to one big
  string; after it otherwise); loops run at most `max_iterations` iterations in all (`range()` itself is capped
  at 100,000 items by the sandbox); and the render stops once it has taken `timeout_s` seconds (checked at every
  call, attribute or item access, operator, loop iteration and output chunk).

Every failure is a `ChatTemplateError` (a ValueError) naming the template's file: at load, a template that cannot
be used; at render, one that refused the conversation (`raise_exception`) or broke a rule or a limit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["ChatTemplate", "ChatTemplateError", "TemplateLimits", "load_chat_template"]


class ChatTemplateError(ValueError):
    """A chat template that cannot be loaded or rendered; `file` names it (e.g. 'tokenizer_config.json')."""

    def __init__(self, file: str, message: str):
        super().__init__(f"chat template {file}: {message}")
        self.file = file


@dataclasses.dataclass(frozen=True)
class TemplateLimits:
    """What one render may use: characters of any value it builds or prints and of its output (`max_chars`),
    loop iterations in all (`max_iterations`) and wall time (`timeout_s`)."""
    max_chars: int = 4 << 20
    max_iterations: int = 1_000_000
    timeout_s: float = 2.0

    def __post_init__(self):
        if self.max_chars < 1 or self.max_iterations < 1 or not self.timeout_s > 0:
            raise ValueError(f"template limits must be positive, got {self}")


class ChatTemplate:
    """A compiled, sandboxed chat template (see the module docstring); `render(**variables)` -> the text."""

    def __init__(self, compiled: Any, file: str, limits: TemplateLimits):
        self._compiled, self.file, self.limits = compiled, file, limits

    def render(self, **variables: Any) -> str:
        """The template's text for `variables`; ChatTemplateError (naming the file) when the template refuses
        them (`raise_exception`), breaks a sandbox rule or exceeds a limit."""
        return self._compiled.render(variables)


def load_chat_template(source: str, file: str, limits: TemplateLimits | None = None) -> ChatTemplate:
    """Compiles `source` (the text of the checkpoint file `file`) in the sandbox; ChatTemplateError naming the
    file when it is not valid Jinja or uses what the sandbox refuses at load (`_template_sandbox.static_check`)."""
    if not isinstance(source, str) or not source:
        raise ChatTemplateError(file, "is empty or not a string")
    limits = limits or TemplateLimits()
    if len(source) > limits.max_chars:
        raise ChatTemplateError(file, f"has {len(source)} characters, more than the limit of {limits.max_chars}")
    try:
        from . import _template_sandbox  # jinja2: the `serve` extra
    except ImportError as e:  # pragma: no cover - the `serve` extra is missing
        raise ImportError(f"chat templates need the `jinja2` package (pip install jinja2): {e}") from None
    return ChatTemplate(_template_sandbox.compile_template(source, file, limits), file, limits)
