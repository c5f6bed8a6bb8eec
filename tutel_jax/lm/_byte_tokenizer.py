"""The byte-level tokenizer of the tutel-jax language models: token id = UTF-8 byte value (vocab 256).

    encode("def f():")  ->  [100, 101, 102, 32, 102, 40, 41, 58]
    decode(ids)         ->  str (invalid UTF-8 becomes U+FFFD)
    write_tokenizer(d)  ->  d/tokenizer.json + d/tokenizer_config.json

`write_tokenizer` writes the same mapping as an HF `tokenizers` file, so that a checkpoint directory tokenizes
text for the server (`serving.tokenizer.TextCodec`), the `generate` command and HF transformers
(`PreTrainedTokenizerFast`) alike: a BPE model without merges over GPT-2's byte-level alphabet, in which the
symbol of byte b has id b, behind the ByteLevel pre-tokenizer (text -> UTF-8 bytes -> one symbol per byte) and
decoder. There are no special tokens (no BOS / EOS / padding ids). tokenizer_config.json carries a plain-text
chat template (`CHAT_TEMPLATE`) for /v1/chat/completions.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["VOCAB_SIZE", "CHAT_TEMPLATE", "byte_symbols", "build_tokenizer", "encode", "decode", "write_tokenizer"]

VOCAB_SIZE = 256

# one "role: content" line per message, then the assistant's prefix; content may be a string or a list of
# {"type": "text", "text": ...} parts (the server passes strings; HF's apply_chat_template may pass parts)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- message['role'] + ': ' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}"
)


def byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet, the symbol of each byte 0..255 in byte order (the ByteLevel pre-tokenizer's
    map): printable Latin-1 bytes ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for themselves; the other 68 bytes take
    the code points 256, 257, ... in byte order (space -> 'Ġ', newline -> 'Ċ')."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    kept = set(printable)
    symbols, extra = [], 0
    for b in range(VOCAB_SIZE):
        if b in kept:
            symbols.append(chr(b))
        else:
            symbols.append(chr(VOCAB_SIZE + extra))
            extra += 1
    return symbols


def build_tokenizer() -> Any:
    """The `tokenizers.Tokenizer` whose ids are the UTF-8 bytes of the text (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {s: b for b, s in enumerate(byte_symbols())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def encode(text: str) -> list[int]:
    """The token ids of `text`: its UTF-8 bytes."""
    if not isinstance(text, str):
        raise ValueError(f"encode: text must be a str, got {type(text).__name__}")
    return list(text.encode("utf-8"))


def decode(ids: Iterable[int]) -> str:
    """The text of token ids 0..255 (bytes; invalid UTF-8 sequences become U+FFFD)."""
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < VOCAB_SIZE]
    if bad:
        raise ValueError(f"decode: ids must be bytes in [0, {VOCAB_SIZE}), got {bad[:5]}")
    return bytes(ids).decode("utf-8", errors="replace")


def write_tokenizer(path: str | os.PathLike, *, model_max_length: int | None = None) -> Path:
    """Writes `tokenizer.json` and `tokenizer_config.json` (PreTrainedTokenizerFast, no special tokens, the
    chat template, `model_max_length` when given) into directory `path` (created if needed); returns it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(path / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False, "add_eos_token": False,
        "bos_token": None, "eos_token": None, "pad_token": None, "unk_token": None,
        "clean_up_tokenization_spaces": False,  # decode must give the bytes back, spaces included
        "chat_template": CHAT_TEMPLATE,
    }
    if model_max_length is not None:
        config["model_max_length"] = int(model_max_length)
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
