"""The native MoE kernel on every instruction set this CPU runs, side by side: gpt-oss-20b's MoE layer (E=32,
k=4, M=I=2880, MXFP4 experts, GPT-OSS GLU; one `native.moe_experts` call) at 1, 8 and 512 tokens, with int8
activations (the models' default on CPU: `activations='int8'`, a register pass of rows at a time) and float32
ones.

    python benchmarks/native_isa.py [--rounds 3]     # writes benchmarks/results/native_isa.{json,md}
    python benchmarks/native_isa.py --quick          # the CI smoke test: a small layer, one round

Each ISA (`tutel_jax.native._build.cpu_isas()`: AVX-512, AVX2, NEON, portable) runs in its own child process with
`TUTEL_JAX_NATIVE_ISA` set, the rounds interleaved (ISA by ISA, round by round), the same threads (XLA's
intra-op pool on every usable CPU) and the same random packed weights. A child reports, per token count, the best
of its repetitions; the report gives the medians over rounds. GB/s = the used experts' packed bytes (codes and
scales) / seconds; GFLOP/s = 2 k tokens (2IM + IM) / seconds. Ratios are against the best path: the best ISA of
the CPU with int8 activations, in GB/s up to 8 tokens and in GFLOP/s beyond. At 512 tokens every expert has more
rows than a register pass: int8 activations go a register pass at a time over cached weight rows, float32 ones
run the many-row kernel (weight rows decoded to float32 tiles).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    machine_info,
    markdown_table,
    quick_parser,
    results_path,
    write_results,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "native_isa.json"
LAYER = {"experts": 32, "k": 4, "model_dim": 2880, "hidden": 2880}
QUICK_LAYER = {"experts": 8, "k": 2, "model_dim": 256, "hidden": 256}
TOKENS = (1, 8, 512)
#: the activations measured, the best path's first (`native.moe_experts(activations=...)`)
ACTIVATIONS = ("int8", "float32")
QUICK_TOKENS = (1, 8, 32)


def child(layer: dict, tokens: tuple[int, ...], reps: int) -> dict:
    """In the child (TUTEL_JAX_NATIVE_ISA set): the layer's time per token count, and the ISA in effect."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.quant import Mxfp4Weight
    from tutel_jax import native

    e, k, m, i = layer["experts"], layer["k"], layer["model_dim"], layer["hidden"]
    rng = np.random.default_rng(0)

    def mxfp4(n: int, d: int) -> Mxfp4Weight:  # random codes, scales near 2^-6 (the values do not matter)
        return Mxfp4Weight(jnp.asarray(rng.integers(0, 256, (e, n, d // 32, 16), dtype=np.uint8)),
                           jnp.asarray(rng.integers(118, 124, (e, n, d // 32), dtype=np.uint8)))

    w1, w2 = mxfp4(2 * i, m), mxfp4(m, i)
    per_expert = sum(np.asarray(a).nbytes for a in jax.tree_util.tree_leaves((w1, w2))) / e
    out = {"isa": native.isa(), "paths": {a: {} for a in ACTIVATIONS}}
    inputs = {}  # the same tokens and routing for both activations
    for t in tokens:
        inputs[t] = (jnp.asarray(rng.normal(size=(t, m)).astype(np.float32)),
                     jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(t)], 1).astype(np.int32)),
                     jnp.ones((k, t), jnp.float32), jnp.full((k, t), 1.0 / k, jnp.float32))
    for activations in ACTIVATIONS:
        layer_fn = jax.jit(lambda x, ids, enc, dec, a=activations: native.moe_experts(
            x, ids, enc, dec, w1, w2, glu="gpt_oss", activations=a))
        per = out["paths"][activations]
        for t in tokens:
            x, ids, enc, dec = inputs[t]
            layer_fn(x, ids, enc, dec).block_until_ready()
            best = float("inf")
            for _ in range(max(1, reps if t <= 8 else reps // 10)):
                start = time.perf_counter()
                layer_fn(x, ids, enc, dec).block_until_ready()
                best = min(best, time.perf_counter() - start)
            used = len(np.unique(np.asarray(ids)))
            per[str(t)] = {"seconds": best, "gb_per_s": used * per_expert / best / 1e9,
                           "gflop_per_s": 2 * t * k * 3 * i * m / best / 1e9}
    return out


def run_child(isa: str, quick: bool) -> dict:
    env = dict(os.environ, TUTEL_JAX_NATIVE_ISA=isa, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child"] + (["--quick"] if quick else [])
    done = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"native_isa: the {isa} child failed (exit {done.returncode}): "
                         f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else 'no output'}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(rounds: dict[str, list[dict]], tokens: tuple[int, ...]) -> dict[str, dict]:
    """Medians over rounds per ISA, activations and token count ({isa: {activations: {tokens: ...}}}), and the
    ratio to the best path (the first, best ISA with int8 activations)."""
    out: dict[str, dict] = {}
    for isa, runs in rounds.items():
        out[isa] = {a: {t: {key: statistics.median(r["paths"][a][t][key] for r in runs)
                            for key in ("seconds", "gb_per_s", "gflop_per_s")} for t in map(str, tokens)}
                    for a in ACTIVATIONS}
    best = out[next(iter(out))][ACTIVATIONS[0]]
    for per in out.values():
        for a in ACTIVATIONS:
            for t in map(str, tokens):
                key = ratio_metric(int(t))
                per[a][t]["ratio_to_best"] = per[a][t][key] / best[t][key]
    return out


def ratio_metric(tokens: int) -> str:
    """What a ratio compares: GB/s at decode sizes (the used experts' bytes: children may route differently),
    GFLOP/s for a prefill."""
    return "gb_per_s" if tokens <= 8 else "gflop_per_s"


def markdown(result: dict) -> str:
    layer = result["layer"]
    rows = []
    for isa, per in result["isas"].items():
        for a, by_tokens in per.items():
            for t, v in by_tokens.items():
                rows.append([isa, a, t, f"{v['seconds'] * 1e3:.2f}", f"{v['gb_per_s']:.2f}",
                             f"{v['gflop_per_s']:.1f}", f"{v['ratio_to_best']:.2f}x"])
    head = (f"MoE layer E={layer['experts']}, k={layer['k']}, M=I={layer['model_dim']}, MXFP4, one native call; "
            f"{result['rounds']} interleaved rounds (medians), {result['machine']['cpu_affinity']} CPUs.")
    return head + "\n\n" + markdown_table(["ISA", "activations", "tokens", "ms", "GB/s", "GFLOP/s",
                                           "speed / best path"], rows, "lllrrrr")


def main(argv: list[str] | None = None) -> int:
    parser = quick_parser(__doc__, "a small layer, one round (the CI smoke test)", DEFAULT_OUT)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    layer, tokens = (QUICK_LAYER, QUICK_TOKENS) if args.quick else (LAYER, TOKENS)
    if args.child:
        print(json.dumps(child(layer, tokens, reps=3 if args.quick else 30)))
        return 0
    from tutel_jax.native import _build as build

    rounds_n = 1 if args.quick else args.rounds
    rounds: dict[str, list[dict]] = {isa: [] for isa in build.cpu_isas()}
    for r in range(rounds_n):
        # interleaved: every ISA sees the machine in the same state, round by round
        for isa in rounds:  # noqa: PLC0206
            rounds[isa].append(run_child(isa, args.quick))
            print(f"round {r + 1} {isa}: " + ", ".join(
                f"{a} {t} tok {v['gb_per_s']:.2f} GB/s" for a, per in rounds[isa][-1]["paths"].items()
                for t, v in per.items()), flush=True)
    mismatched = [isa for isa, runs in rounds.items() if any(run["isa"] != isa for run in runs)]
    if mismatched:
        raise SystemExit(f"native_isa: the children of {mismatched} ran another ISA")
    result = {"layer": layer, "rounds": rounds_n, "isas": summarize(rounds, tokens), "per_round": rounds,
              "machine": machine_info()}
    text = markdown(result)
    print(text)
    write_results(results_path(args, DEFAULT_OUT), result, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
