"""Text helpers shared by the server and the `generate` command: a checkpoint's tokenizer.json (loaded with the
`tokenizers` package), its end-of-sequence ids, incremental decoding of a growing token sequence into text
deltas (safe for multi-byte characters split over tokens and for stop strings not yet complete), and
`TextCodec`, a checkpoint's optional text support (tokenizer + chat template).

Nothing a checkpoint holds is trusted: every file read from it (`checkpoint_file`) must resolve inside its
directory (no absolute names, no `..`, no symlink leading out; in a Hugging Face cache snapshot a symlink may lead
into the same repository's blobs/), and its chat template renders in a sandbox (`chat_template`). In chat
prompts, the text of a request (message contents, names, tools) never becomes a control token: a special
token's text in it is encoded as plain text; only the template's own special tokens are special."""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..checkpoint import resolve_inside as resolve_in_checkpoint
from ._chat_template import ChatTemplate, ChatTemplateError, TemplateLimits, load_chat_template

__all__ = ["TOKENIZER_FILE", "ChatTemplateError", "CheckpointPathError", "IncrementalDecoder", "TextCodec", "TextUnavailableError",
           "checkpoint_file", "encode", "eos_token_ids", "load_tokenizer", "resolve_inside", "safe_text_end"]

TOKENIZER_FILE = "tokenizer.json"
TEMPLATE_FILES = ("tokenizer_config.json", "chat_template.jinja", "chat_template.json")

log = logging.getLogger(__name__)


class CheckpointPathError(ValueError):
    """A file name of a checkpoint that does not stay inside its directory."""


def resolve_inside(root: str | os.PathLike, name: str, what: str) -> Path:
    """The path of the file `name` of checkpoint directory `root`, resolved (symlinks followed), once
    `checkpoint.resolve_inside` has checked that it stays inside (Hugging Face cache snapshots included):
    CheckpointPathError naming `what` and `name` otherwise."""
    try:
        return resolve_in_checkpoint(root, name, what).resolve()
    except ValueError as e:
        raise CheckpointPathError(str(e)) from None


def checkpoint_file(checkpoint: str | os.PathLike, name: str) -> Path | None:
    """The checkpoint's file `name` when it exists (resolved inside the checkpoint; ValueError naming it when it
    leads out), else None."""
    path = resolve_inside(checkpoint, name, name)
    return path if path.is_file() else None


def load_tokenizer(checkpoint: str | os.PathLike) -> Any:
    """The `tokenizers.Tokenizer` of a checkpoint directory (its tokenizer.json).

    Raises FileNotFoundError naming the missing file, ImportError when the `tokenizers` package is absent."""
    f = checkpoint_file(checkpoint, TOKENIZER_FILE)
    if f is None:
        raise FileNotFoundError(f"{Path(checkpoint) / TOKENIZER_FILE} not found: text needs the checkpoint's "
                                f"{TOKENIZER_FILE} (or give token ids instead)")
    try:
        from tokenizers import Tokenizer  # optional dependency (the `serve` extra)
    except ImportError as e:
        raise ImportError(f"reading {f} needs the `tokenizers` package (pip install tokenizers)") from e
    try:
        return Tokenizer.from_file(str(f))
    except Exception as e:  # noqa: BLE001 - the Rust parser's errors: one line naming the file
        raise ValueError(f"{TOKENIZER_FILE}: not a valid tokenizer file ({' '.join(str(e).split())[:200]})") \
            from None


def encode(tokenizer: Any, text: str) -> list[int]:
    """The token ids of `text`, as written (no special tokens such as BOS are added)."""
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def eos_token_ids(checkpoint: str | os.PathLike, config: dict) -> set[int]:
    """The end-of-sequence ids named by `config` (config.json) and the checkpoint's generation_config.json."""
    ids: set[int] = set()
    sources = [config]
    gen = checkpoint_file(checkpoint, "generation_config.json")
    if gen is not None:
        try:
            loaded = json.loads(gen.read_text())
        except (ValueError, UnicodeDecodeError):
            loaded = None
        if isinstance(loaded, dict):
            sources.append(loaded)
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
    `chat_template`, chat_template.jinja or chat_template.json), loaded on first use or by `check()`. Without
    them only token ids work; asking for text then raises TextUnavailableError. The template renders in the
    sandbox of `chat_template` within `limits`."""

    def __init__(self, path: str | os.PathLike, limits: TemplateLimits | None = None):
        self.path = Path(path)
        self.limits = limits or TemplateLimits()
        self._tok: Any = None
        self._plain: Any = None  # the tokenizer with special-token parsing off (request text in chat prompts)
        self._loaded = False
        self._template: ChatTemplate | None = None
        self._template_loaded = False
        self._special_ids: frozenset[int] = frozenset()
        self._special_texts: tuple[str, ...] = ()
        self._normalized_specials = False

    def check(self) -> None:
        """Loads the tokenizer and the chat template now (a server does at startup): ValueError naming the file
        when one leads outside the checkpoint directory, ChatTemplateError (a ValueError) when the template
        cannot be used. A checkpoint without them is fine (token ids only)."""
        if self.tokenizer is not None:
            try:
                self._chat_template()
            except TextUnavailableError:
                pass  # no template: chat completions answer 400, completions work

    @property
    def tokenizer(self) -> Any:
        """The `tokenizers.Tokenizer`, or None when the checkpoint has no usable tokenizer.json."""
        if not self._loaded:
            try:
                tok = load_tokenizer(self.path)
            except FileNotFoundError:
                tok = None  # token-id prompts only
            except CheckpointPathError:
                raise  # a file leading out of the checkpoint is refused, not skipped
            except Exception as e:  # noqa: BLE001 - missing package or unreadable file
                log.warning("tokenizer.json not usable (%s); token-id prompts only", e)
                tok = None
            self._loaded = True
            if tok is not None:
                self._set_tokenizer(tok)
        return self._tok

    def _set_tokenizer(self, tok: Any) -> None:
        specials = {i: t for i, t in tok.get_added_tokens_decoder().items() if t.special}
        self._special_ids = frozenset(specials)
        self._special_texts = tuple(t.content for t in specials.values())
        self._normalized_specials = any(t.normalized for t in specials.values())
        plain = type(tok).from_str(tok.to_str())  # a `tokenizers.Tokenizer` (the class of `tok`)
        plain.encode_special_tokens = True  # special tokens' text is encoded as text
        self._tok, self._plain = tok, plain

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        """The token ids of a raw prompt (a completion's `prompt`: written by the client, which may send token
        ids as well, so special tokens' text is parsed as in tokenizer.json)."""
        if self.tokenizer is None:
            raise TextUnavailableError("this model has no tokenizer (no tokenizer.json or the `tokenizers` package "
                                       "is missing): send the prompt as a list of token ids", param,
                                       "tokenizer_unavailable")
        return encode(self.tokenizer, text)

    def decode(self, ids: Sequence[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(list(ids))

    def _read_template(self) -> tuple[str, str] | None:
        """(source, file name) of the checkpoint's chat template, or None when it has none."""
        max_bytes = 4 * self.limits.max_chars + (64 << 20)  # tokenizer_config.json may also list many tokens
        for name in TEMPLATE_FILES:
            f = checkpoint_file(self.path, name)
            if f is None:
                continue
            if f.stat().st_size > max_bytes:
                raise ChatTemplateError(name, f"is larger than {max_bytes} bytes")
            try:
                text = f.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise ChatTemplateError(name, "is not UTF-8 text") from None
            if name.endswith(".jinja"):
                return text, name
            try:
                tmpl = json.loads(text).get("chat_template")
            except (ValueError, AttributeError):
                if name == "tokenizer_config.json":
                    log.warning("%s is not a JSON object; no chat template from it", name)
                    continue
                raise ChatTemplateError(name, "is not a JSON object") from None
            if tmpl is None:
                continue
            if isinstance(tmpl, list):  # transformers' named templates: the one named "default"
                named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
                if "default" not in named:
                    raise ChatTemplateError(name, "lists chat templates but none named 'default'")
                tmpl = named["default"]
            if not isinstance(tmpl, str):
                raise ChatTemplateError(name, f"chat_template must be a string, got {type(tmpl).__name__}")
            return tmpl, name
        return None

    def _chat_template(self) -> ChatTemplate:
        if not self._template_loaded:
            found = self._read_template()
            self._template = None if found is None else load_chat_template(found[0], found[1], self.limits)
            self._template_loaded = True
        if self._template is None:
            raise TextUnavailableError("this model has no chat template: use /v1/completions", "messages",
                                       "chat_template_unavailable")
        return self._template

    def _neutral(self, value: Any, originals: list[str], marker: str) -> Any:
        """`value` (request data: strings, lists, dicts) with each special token's text in its strings replaced by
        a placeholder (`marker`, k, U+E001) (k: its index in `originals`), so it cannot act as a control token."""
        if isinstance(value, str):
            return self._neutral_text(value, originals, marker)
        if isinstance(value, list):
            return [self._neutral(v, originals, marker) for v in value]
        if isinstance(value, dict):
            return {self._neutral(k, originals, marker): self._neutral(v, originals, marker) for k, v in value.items()}
        return value

    def _neutral_text(self, s: str, originals: list[str], marker: str) -> str:
        if not s or not self._special_ids:
            return s
        if not self._normalized_specials and not any(t in s for t in self._special_texts):
            return s  # the common case: no special token's text at all
        # the tokenizer finds special tokens as it would in the prompt (normalized ones included)
        enc = self.tokenizer.encode(s, add_special_tokens=False)
        spans = [enc.offsets[k] for k, i in enumerate(enc.ids) if i in self._special_ids]
        if not spans:
            return s
        out, last = [], 0
        for a, b in spans:
            out.append(s[last:a])
            out.append(f"{marker}{len(originals)}\ue001")
            originals.append(s[a:b])
            last = b
        out.append(s[last:])
        return "".join(out)

    def _encode_rendered(self, text: str, originals: list[str], marker: str) -> list[int]:
        """The ids of a rendered chat prompt: the template's text with its special tokens, each placeholder as
        the plain text it stands for."""
        if not originals:
            return encode(self.tokenizer, text)
        pieces = re.split(re.escape(marker) + r"(\d+)\ue001", text)
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 2 == 0:
                ids += encode(self.tokenizer, piece) if piece else []
            elif int(piece) < len(originals):
                ids += self._plain.encode(originals[int(piece)], add_special_tokens=False).ids
        return ids

    def chat_prompt(self, messages: list[dict], tools: list | None = None) -> list[int]:
        """The token ids of `messages` ({role, content, ...} dicts) rendered by the chat template, with the
        generation prompt added (`tools`, when given, is the template's `tools` variable). Special tokens' text
        in the messages and tools is encoded as plain text. Raises TextUnavailableError (no tokenizer or
        template; content that is not text) or ChatTemplateError (the template failed or refused)."""
        if self.tokenizer is None:
            raise TextUnavailableError("chat completions need a tokenizer (tokenizer.json) and a chat template; "
                                       "this model has none: use /v1/completions with token-id prompts",
                                       "messages", "tokenizer_unavailable")
        template = self._chat_template()
        marker = "\ue000" + secrets.token_hex(8) + ":"  # unguessable: request text cannot forge a placeholder
        originals: list[str] = []
        plain = [self._neutral({**m, "content": message_text(m.get("content"), i)}, originals, marker)
                 for i, m in enumerate(messages)]
        variables: dict[str, Any] = {"messages": plain, "add_generation_prompt": True, "bos_token": "",
                                     "eos_token": ""}
        if tools is not None:
            variables["tools"] = self._neutral(tools, originals, marker)
        return self._encode_rendered(template.render(**variables), originals, marker)
