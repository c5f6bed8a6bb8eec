"""Text helpers shared by the server and the `generate` command: a checkpoint's tokenizer.json (loaded with the
`tokenizers` package), its end-of-sequence ids, and incremental decoding of a growing token sequence into
text deltas (safe for multi-byte characters split over tokens and for stop strings not yet complete)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["TOKENIZER_FILE", "IncrementalDecoder", "encode", "eos_token_ids", "load_tokenizer", "safe_text_end"]

TOKENIZER_FILE = "tokenizer.json"


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
