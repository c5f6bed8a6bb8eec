"""Text helpers shared by the server and the `generate` command: a checkpoint's tokenizer.json (loaded with the
`tokenizers` package), its end-of-sequence ids, incremental decoding of a growing token sequence into text
deltas (safe for multi-byte characters split over tokens and for stop strings not yet complete), and
`TextCodec`, a checkpoint's optional text support (tokenizer + chat template) loaded on first use."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["TOKENIZER_FILE", "IncrementalDecoder", "TextCodec", "TextUnavailableError", "encode", "eos_token_ids",
           "load_tokenizer", "safe_text_end"]

TOKENIZER_FILE = "tokenizer.json"

log = logging.getLogger(__name__)


def load_tokenizer(checkpoint: str | os.PathLike) -> Any:
    """The `tokenizers.Tokenizer` of a checkpoint directory (its tokenizer.json).

    Raises FileNotFoundError naming the missing file, ImportError when the `tokenizers` package is absent."""
    f = Path(checkpoint) / TOKENIZER_FILE
    if not f.is_file():
        raise FileNotFoundError(f"{f} not found: text needs the checkpoint's {TOKENIZER_FILE} "
                                "(or give token ids instead)")
    try:
        from tokenizers import Tokenizer  # optional dependency (the `serve` extra)
    except ImportError as e:
        raise ImportError(f"reading {f} needs the `tokenizers` package (pip install tokenizers)") from e
    return Tokenizer.from_file(str(f))


def encode(tokenizer: Any, text: str) -> list[int]:
    """The token ids of `text`, as written (no special tokens such as BOS are added)."""
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def eos_token_ids(checkpoint: str | os.PathLike, config: dict) -> set[int]:
    """The end-of-sequence ids named by `config` (config.json) and the checkpoint's generation_config.json."""
    ids: set[int] = set()
    sources = [config]
    gen = Path(checkpoint) / "generation_config.json"
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


def safe_text_end(text: str, stop_strs: Iterable[str] = ()) -> int:
    """How much of `text` (decoded so far) can be shown: it excludes a trailing U+FFFD (the decoding of an
    incomplete UTF-8 sequence, completed by a later token), everything from a stop string on (the text is cut
    there) and the longest tail that begins a stop string (it may still become that stop string)."""
    end = len(text.rstrip("\ufffd"))
    cut = end
    for s in stop_strs:
        found = text.find(s, 0, end)
        if found >= 0:
            cut = min(cut, found)
        for k in range(min(len(s) - 1, end), 0, -1):
            if text.endswith(s[:k], 0, end):
                cut = min(cut, end - k)
                break
    return cut


class IncrementalDecoder:
    """Text deltas of a growing token sequence: each `push` decodes all ids so far and returns the part not
    returned yet (merged and multi-byte tokens decode correctly because the whole sequence is decoded; text
    that may still change is held back, see `safe_text_end`)."""

    def __init__(self, tokenizer: Any, stop_strs: Sequence[str] = ()):
        self.tokenizer, self.stop_strs = tokenizer, tuple(stop_strs)
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of `text` returned so far

    def push(self, token: int) -> str:
        """Appends one token; returns the new text that is safe to show ("" when none is yet)."""
        self.ids.append(int(token))
        self.text = self.tokenizer.decode(self.ids)
        end = safe_text_end(self.text, self.stop_strs)
        delta = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta

    def rest(self, final_text: str | None = None) -> str:
        """What is left to show at the end: the held-back tail of `final_text` (default: all text so far)."""
        text = self.text if final_text is None else final_text
        delta = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return delta


class TextUnavailableError(ValueError):
    """Text was asked of a checkpoint that cannot provide it (no tokenizer, no chat template, a missing package,
    or chat content that is not text). `param` names the request field, `code` says which."""

    def __init__(self, message: str, param: str, code: str):
        super().__init__(message)
        self.param, self.code = param, code


def message_text(content: Any, index: int) -> str:
    """The text of a chat message's `content`: a string, null, or a list of OpenAI content parts of which only
    `{"type": "text", "text": ...}` parts are supported (joined with newlines)."""
    if content is None or isinstance(content, str):
        return content or ""
    param = f"messages[{index}].content"
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise TextUnavailableError(f"{param}: only text content parts are supported, got {kind!r}", param,
                                           "unsupported_content")
            texts.append(part["text"])
        return "\n".join(texts)
    raise TextUnavailableError(f"{param} must be a string or a list of text parts, got {type(content).__name__}",
                               param, "invalid_type")


class TextCodec:
    """A checkpoint directory's optional text support: its tokenizer.json and chat template (tokenizer_config.json
    `chat_template` or chat_template.jinja), both loaded on first use. Without them only token ids work; asking
    for text then raises TextUnavailableError."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._tok = None
        self._loaded = False
        self._template = None

    @property
    def tokenizer(self) -> Any:
        """The `tokenizers.Tokenizer`, or None when the checkpoint has no usable tokenizer.json."""
        if not self._loaded:
            self._loaded = True
            try:
                self._tok = load_tokenizer(self.path)
            except FileNotFoundError:
                pass  # token-id prompts only
            except Exception as e:  # noqa: BLE001 - missing package or unreadable file
                log.warning("tokenizer.json not usable (%s); token-id prompts only", e)
        return self._tok

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        if self.tokenizer is None:
            raise TextUnavailableError("this model has no tokenizer (no tokenizer.json or the `tokenizers` package "
                                       "is missing): send the prompt as a list of token ids", param,
                                       "tokenizer_unavailable")
        return encode(self.tokenizer, text)

    def decode(self, ids: Sequence[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(list(ids))

    def _chat_template(self) -> Any:
        if self._template is None:
            cfg = self.path / "tokenizer_config.json"
            tmpl = None
            if cfg.is_file():
                try:
                    tmpl = json.loads(cfg.read_text()).get("chat_template")
                except (ValueError, AttributeError):
                    log.warning("%s is not a JSON object; no chat template from it", cfg)
            if not tmpl and (self.path / "chat_template.jinja").is_file():
                tmpl = (self.path / "chat_template.jinja").read_text()
            if not isinstance(tmpl, str) or not tmpl:
                raise TextUnavailableError("this model has no chat template: use /v1/completions", "messages",
                                           "chat_template_unavailable")
            try:
                import jinja2
            except ImportError:
                raise TextUnavailableError("chat templates need the `jinja2` package", "messages",
                                           "chat_template_unavailable") from None
            self._template = jinja2.Environment().from_string(tmpl)
        return self._template

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """The token ids of `messages` ({role, content} dicts) rendered by the chat template, with the
        generation prompt added."""
        if self.tokenizer is None:
            raise TextUnavailableError("chat completions need a tokenizer (tokenizer.json) and a chat template; "
                                       "this model has none: use /v1/completions with token-id prompts",
                                       "messages", "tokenizer_unavailable")
        plain = [{**m, "content": message_text(m.get("content"), i)} for i, m in enumerate(messages)]
        text = self._chat_template().render(messages=plain, add_generation_prompt=True, bos_token="",
                                            eos_token="")
        return self.encode(text, "messages")
