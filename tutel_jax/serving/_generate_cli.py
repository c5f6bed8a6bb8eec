"""Generate from an HF MoE checkpoint: token-id prompts (--ids) or text prompts (--prompt, decoded with the
checkpoint's tokenizer.json through the `tokenizers` package).

    tutel-jax generate tests/fixtures/hf/qwen3_moe --ids 5,17,42,7 --ids 9,3 --max-new-tokens 8
    tutel-jax generate CHECKPOINT --prompt "The capital of France is" --eos --stream
    python examples/generate.py tests/fixtures/hf/gpt_oss --ids 1,2,3 --temperature 0.8 --top-p 0.9 --seed 1

Prompts of different lengths are batched with padding. Prints each prompt's new tokens (or text) and the
throughput of a second, already compiled run (the first run's time includes compilation). --stream prints the
first run's tokens as they are produced: a single prompt as running text (or ids), several prompts as one line
per step.

Sampling flags follow the rules of the library's `generate` and of the server (`tutel_jax.serving._sampling`):
--temperature finite and >= 0, --top-p in (0, 1], --top-k >= 0 (0: off), --max-new-tokens >= 1 and, with the
longest prompt, within the model's context. Every error is one line on stderr (`tutel-jax generate: error:
...`) with exit code 2, as is a generation that meets non-finite (NaN / inf) logits.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, TextIO

import numpy as np

from .. import models
from ..native import NativeKernelError
from ._generate import generate
from ._tokenizer import eos_token_ids, IncrementalDecoder, encode, load_tokenizer

from ..layer import execution
from ..cli_args import CommandParser, add_compile_cache_argument, add_dtype_argument, checked, int_in_range
from ..core import enable_compile_cache
from ._sampling import check_max_new_tokens, check_temperature, check_top_k, check_top_p


def _parse_ids(text: str) -> list[int]:
    """argparse type: comma-separated token ids, each in [0, 2**31) (the int32 of the model's inputs)."""
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("needs at least one token id")
    bad = [t for t in ids if not 0 <= t < 2 ** 31]
    if bad:
        raise argparse.ArgumentTypeError(f"token ids must be in [0, 2**31), got {bad[0]}")
    return ids


def _parser() -> CommandParser:
    ap = CommandParser(prog="tutel-jax generate", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="HF checkpoint directory (config.json + safetensors [+ tokenizer.json])")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--ids", type=_parse_ids, action="append",
                     help="comma-separated prompt token ids; repeat for a batch")
    src.add_argument("--prompt", action="append",
                     help="a text prompt (needs tokenizer.json in the checkpoint); repeat for a batch")
    ap.add_argument("--max-new-tokens", type=checked(check_max_new_tokens, int), default=16,
                    help="new tokens per prompt (>= 1; prompt + new tokens within the model's context)")
    ap.add_argument("--temperature", type=checked(check_temperature), default=0.0,
                    help="finite, >= 0; 0: greedy")
    ap.add_argument("--top-k", type=checked(check_top_k, int), default=None,
                    help="sample among the k most likely tokens (0: off)")
    ap.add_argument("--top-p", type=checked(check_top_p), default=None,
                    help="sample within the smallest set of tokens of probability >= p, in (0, 1] (1: off)")
    ap.add_argument("--seed", type=int_in_range(-(2 ** 63), 2 ** 63 - 1), default=0)
    ap.add_argument("--stop-token-ids", type=_parse_ids, default=None,
                    help="comma-separated token ids that end a prompt's completion")
    ap.add_argument("--eos", action="store_true",
                    help="also stop at the checkpoint's eos_token_id(s) (config.json, generation_config.json)")
    ap.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    ap.add_argument("--on-device", action="store_true", help="all decode steps in one compiled lax.scan")
    add_dtype_argument(ap)
    add_compile_cache_argument(ap)
    execution.add_arguments(ap)
    return ap


class StreamPrinter:
    """A `generate` stream_callback that prints each step's new tokens: running text (or ids) for one prompt,
    one line per step (`step i: [row] piece ...`) for several. A row's stop token ends it and is not shown."""

    def __init__(self, rows: int, stops: set[int], tokenizer: Any = None, out: TextIO | None = None):
        self.stops, self.out = stops, out if out is not None else sys.stdout
        self.finished = np.zeros(rows, bool)
        self.decoders = [IncrementalDecoder(tokenizer) for _ in range(rows)] if tokenizer is not None else None

    def _piece(self, b: int, token: int) -> str:
        if token in self.stops:
            self.finished[b] = True
            return self.decoders[b].rest() if self.decoders else ""
        if self.decoders:
            return self.decoders[b].push(token)
        return f"{token} "

    def __call__(self, step: int, tokens: np.ndarray) -> None:
        pieces = {b: self._piece(b, t) for b, t in enumerate(tokens.tolist()) if not self.finished[b]}
        if len(self.finished) == 1:
            self.out.write(pieces.get(0, ""))
        else:
            self.out.write(f"step {step}: " + "  ".join(f"[{b}] {p!r}" for b, p in pieces.items()) + "\n")
        self.out.flush()

    def close(self) -> None:
        """Prints what the decoders held back (a single prompt: then ends its line)."""
        if len(self.finished) == 1:
            rest = self.decoders[0].rest() if self.decoders and not self.finished[0] else ""
            self.out.write(rest + "\n")
            self.out.flush()


def _text_prompts(checkpoint: str, prompts: list[str]):
    """(tokenizer, prompt ids) of text prompts; raises ValueError/FileNotFoundError/ImportError with a message."""
    for b, p in enumerate(prompts):
        try:
            p.encode("utf-8")
        except UnicodeEncodeError as e:  # bytes of the command line that are not UTF-8
            raise ValueError(f"--prompt {b}: character {e.start} is not valid UTF-8 text") from None
    tok = load_tokenizer(checkpoint)
    ids = [encode(tok, p) for p in prompts]
    for b, p in enumerate(ids):
        if not p:
            raise ValueError(f"prompt {b} ({prompts[b]!r}) encodes to no tokens")
    return tok, ids


def _batch(prompts: list[list[int]], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [B, T], attention_mask [B, T]) of right-padded prompts; ValueError for ids outside the vocabulary."""
    T = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), T), np.int32)
    mask = np.zeros_like(ids)
    for b, p in enumerate(prompts):
        if min(p) < 0 or max(p) >= vocab:
            raise ValueError(f"prompt {b} has token ids outside [0, {vocab})")
        ids[b, :len(p)], mask[b, :len(p)] = p, 1
    return ids, mask


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.stream and args.on_device:
        ap.error("--stream needs the host loop (one dispatch per step): drop --on-device")
    tokenizer, prompts = None, args.ids
    if args.prompt is not None:
        try:
            tokenizer, prompts = _text_prompts(args.checkpoint, args.prompt)
        except (FileNotFoundError, ImportError, ValueError) as e:
            return ap.fail(e)


    try:
        knobs = execution.from_arguments(args, allowed=execution.MODEL_KNOBS)
        enable_compile_cache(args.compile_cache)
    except ValueError as e:
        return ap.fail(e)
    try:
        model = models.from_pretrained(args.checkpoint, dtype=args.dtype, progress=None, **knobs.set_fields())
    except (ValueError, OSError, NativeKernelError) as e:  # a bad checkpoint / option: one line, no traceback
        return ap.fail(f"cannot load {args.checkpoint}: {e}")
    if model.spec.ffn.count("moe") and model.config.get("quantization_config"):
        print(f"{model.spec.model_type}: {models.memory_report(model)}")
    try:
        ids, mask = _batch(prompts, model.spec.vocab_size)
    except ValueError as e:
        return ap.fail(e)
    try:
        eos = eos_token_ids(args.checkpoint, model.config) if args.eos else set()
    except ValueError as e:  # generation_config.json leading out of the checkpoint
        return ap.fail(e)
    stops = set(args.stop_token_ids or []) | eos
    kw = {"attention_mask": mask, "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
          "seed": args.seed, "on_device": args.on_device, "stop_token_ids": sorted(stops)}
    printer = StreamPrinter(len(prompts), stops, tokenizer) if args.stream else None
    try:  # bad values for this model (e.g. beyond its context), non-finite logits: one line
        t0 = time.perf_counter()
        out = generate(model, ids, args.max_new_tokens, stream_callback=printer, **kw)
        first = time.perf_counter() - t0
        if printer is not None:
            printer.close()
        t0 = time.perf_counter()
        out = generate(model, ids, args.max_new_tokens, **kw)
        steady = time.perf_counter() - t0
    except (ValueError, FloatingPointError, NativeKernelError) as e:
        if printer is not None and len(prompts) == 1:
            sys.stdout.write("\n")  # end the streamed line
            sys.stdout.flush()
        return ap.fail(e)
    for b, p in enumerate(prompts):
        new = out.tokens[b, :out.completion_lengths[b]].tolist()
        if tokenizer is None:
            print(f"prompt {b}: {p} -> {new}")
        else:
            text = tokenizer.decode(new[:-1] if new and new[-1] in stops else new)
            print(f"prompt {b}: {args.prompt[b]!r} -> {text!r}")
    n = int(out.completion_lengths.sum())
    print(f"{n} tokens: first run {first:.2f} s (with compilation), then {steady:.3f} s = {n / steady:.1f} tokens/s "
          f"(batch {len(prompts)}, {model.spec.model_type})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
