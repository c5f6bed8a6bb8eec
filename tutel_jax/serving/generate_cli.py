"""Generate tokens from an HF MoE checkpoint (token ids in, token ids out; no tokenizer).

    tutel-jax generate tests/fixtures/hf/qwen3_moe --ids 5,17,42,7 --ids 9,3 --max-new-tokens 8
    python examples/generate.py tests/fixtures/hf/gpt_oss --ids 1,2,3 --temperature 0.8 --top-p 0.9 --seed 1

Prompts of different lengths are batched with padding. Prints each prompt's new tokens and the throughput of a
second, already compiled run (the first run's time includes compilation).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ids takes comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--ids needs at least one token id")
    return ids


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="HF checkpoint directory (config.json + safetensors)")
    ap.add_argument("--ids", type=_parse_ids, action="append", required=True,
                    help="comma-separated prompt token ids; repeat for a batch")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--on-device", action="store_true", help="all decode steps in one compiled lax.scan")
    args = ap.parse_args(argv)

    from tutel_jax.models import from_pretrained
    from tutel_jax.serving import generate

    model = from_pretrained(args.checkpoint)
    vocab = model.spec.vocab_size
    T = max(len(p) for p in args.ids)
    ids = np.zeros((len(args.ids), T), np.int32)
    mask = np.zeros_like(ids)
    for b, p in enumerate(args.ids):
        if min(p) < 0 or max(p) >= vocab:
            print(f"error: prompt {b} has token ids outside [0, {vocab})", file=sys.stderr)
            return 2
        ids[b, :len(p)], mask[b, :len(p)] = p, 1
    kw = dict(attention_mask=mask, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
              seed=args.seed, on_device=args.on_device)
    t0 = time.perf_counter()
    out = generate(model, ids, args.max_new_tokens, **kw)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = generate(model, ids, args.max_new_tokens, **kw)
    steady = time.perf_counter() - t0
    for b, p in enumerate(args.ids):
        print(f"prompt {b}: {p} -> {out.tokens[b].tolist()}")
    n = out.tokens.size
    print(f"{n} tokens: first run {first:.2f} s (with compilation), then {steady:.3f} s = {n / steady:.1f} tokens/s "
          f"(batch {len(args.ids)}, {model.spec.model_type})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
