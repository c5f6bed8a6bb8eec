"""Greedy decode throughput of tutel-jax `serving.generate` against HF transformers `generate` on the same CPU and
the same weights: a random Qwen3-MoE-style model (default hidden 512, 8 layers, 32 experts, top-4, float32).

    python benchmarks/generate.py [--batch 1 8 32] [--prompt_len 32] [--new_tokens 32] [--repeats 3] [--no-hf]
        [--dropless_impl native auto] [--quick] [--out benchmarks/results/generate.json]

Checkpoint: with transformers installed, `Qwen3MoeForCausalLM(Qwen3MoeConfig(...))` after `torch.manual_seed`,
saved with `save_pretrained(safe_serialization=True)` into a temporary folder; without it, an equivalent
config.json + model.safetensors drawn with NumPy (HF's init: N(0, initializer_range) matrices, unit norms). Both
systems load that folder: tutel-jax through `models.from_pretrained` (float32), HF through `from_pretrained`.

Protocol, per batch size B (the same random prompts of `prompt_len` token ids for both systems, greedy):
  tutel-jax, with each MoE implementation of --dropless_impl (default: 'native', the C++ CPU kernel, and 'auto',
  the plain-XLA path), in two modes:
    host    `generate(model, ids, N)`: jitted prefill, then a host loop over a jitted decode step;
    device  `generate(..., on_device=True)`: prefill + lax.scan over the decode steps, one program;
  HF                `model.generate(ids, attention_mask, max_new_tokens=N, min_new_tokens=N, do_sample=False)`
                    under `torch.inference_mode()`, torch.set_num_threads(CPU count);
each also with N = 1 (prefill + one token). Every variant is called once (compile / first call, excluded) and
once more untimed, then all run in interleaved rounds (`common.time_interleaved`); the best of `repeats` runs is
reported (the median too). Rates: generate tok/s = B * N / t(N) (prefill included); decode tok/s =
B * (N - 1) / (t(N) - t(1)) (prefill taken out). tutel-jax's figure is its fastest variant (named); the decode
ratio of each implementation (its faster mode) is reported too.
Greedy agreement: per row, the common prefix of the two systems' new tokens (float32 rounding can flip a late
token of a random model; reported, never failed on).
Results: benchmarks/results/generate.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

if __package__ in (None, ""):  # run as a script: make `tutel_jax` and `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks.common import (fmt_ms, fmt_ratio, machine_info, markdown_table, repo_root,  # noqa: E402
                               time_interleaved, tune_malloc, write_json, write_text)

DEFAULT_OUT = repo_root() / "benchmarks" / "results" / "generate.json"
TUTEL_MODES = ("host", "device")


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """The random Qwen3-MoE model's shape."""

    hidden: int = 512
    layers: int = 8
    experts: int = 32
    top_k: int = 4
    moe_intermediate: int = 256
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 64
    vocab: int = 4096
    initializer_range: float = 0.02


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one run measures."""

    model: ModelSize = ModelSize()
    batches: tuple[int, ...] = (1, 8, 32)
    prompt_len: int = 32
    new_tokens: int = 32
    repeats: int = 3
    seed: int = 0
    # tutel-jax is measured with each of these MoE implementations ('auto': as `from_pretrained` configures the
    # layers, the plain-XLA path; 'native': the C++ CPU kernel)
    dropless_impls: tuple[str, ...] = ("native", "auto")


FULL = Settings()
QUICK = Settings(model=ModelSize(hidden=64, layers=2, experts=8, top_k=2, moe_intermediate=48, heads=4, kv_heads=2,
                                 head_dim=16, vocab=128, initializer_range=0.2),
                 batches=(1, 2), prompt_len=8, new_tokens=4, repeats=1)


# ----------------------------------------------------------------------------------------------- checkpoint


def hf_config_dict(m: ModelSize) -> dict[str, Any]:
    """config.json of a Qwen3-MoE model of shape `m` (every layer MoE, float32, no BOS/EOS)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "dtype": "float32",
        "vocab_size": m.vocab, "hidden_size": m.hidden, "intermediate_size": 2 * m.hidden,
        "num_hidden_layers": m.layers, "num_attention_heads": m.heads, "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim, "hidden_act": "silu", "max_position_embeddings": 4096,
        "initializer_range": m.initializer_range, "rms_norm_eps": 1e-6, "use_cache": True,
        "tie_word_embeddings": False, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "attention_bias": False, "use_sliding_window": False, "sliding_window": None, "attention_dropout": 0.0,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": m.moe_intermediate,
        "num_experts_per_tok": m.top_k, "num_local_experts": m.experts, "norm_topk_prob": True,
        "output_router_logits": False, "router_aux_loss_coef": 0.001,
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
    }


def numpy_tensors(m: ModelSize, seed: int) -> dict[str, np.ndarray]:
    """Random float32 weights under HF's Qwen3-MoE tensor names: matrices N(0, initializer_range), norms 1
    (`tutel_jax.models._random_init`, drawn in a fixed order from one NumPy Generator(seed))."""
    from tutel_jax.models import random_hf_tensors

    return random_hf_tensors(hf_config_dict(m), seed)


def write_numpy_checkpoint(path: Path, m: ModelSize, seed: int) -> None:
    """config.json + model.safetensors of a random model, without torch."""
    from safetensors.numpy import save_file
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config_dict(m), indent=2) + "\n")
    save_file(numpy_tensors(m, seed), str(path / "model.safetensors"), metadata={"format": "pt"})


def hf_available() -> str | None:
    """None when torch and transformers import, else why not."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        return f"torch/transformers not installed ({e})"
    return None


def write_hf_checkpoint(path: Path, m: ModelSize, seed: int) -> None:
    """`save_pretrained` of a freshly initialised `Qwen3MoeForCausalLM` (float32, seeded)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    kw = {k: v for k, v in hf_config_dict(m).items() if k not in ("architectures", "model_type", "num_local_experts")}
    config = Qwen3MoeConfig(**kw, num_experts=m.experts)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(path), safe_serialization=True)


# ----------------------------------------------------------------------------------------------- runners


class Recorder:
    """A zero-argument callable for `time_interleaved` that keeps the new tokens of its last call."""

    def __init__(self, fn: Callable[[], np.ndarray]):
        self.fn = fn
        self.tokens: np.ndarray | None = None

    def __call__(self) -> np.ndarray:
        self.tokens = self.fn()
        return self.tokens


def tutel_runner(model: Any, ids: np.ndarray, new_tokens: int, on_device: bool) -> Recorder:
    """tutel-jax greedy generation of `new_tokens` tokens; returns the new tokens [B, N] (host numpy)."""
    from tutel_jax.serving import generate
    return Recorder(lambda: generate(model, ids, new_tokens, on_device=on_device).tokens)


def hf_runner(model: Any, ids: np.ndarray, new_tokens: int) -> Recorder:
    """HF greedy `generate` of exactly `new_tokens` tokens; returns the new tokens [B, N] (numpy)."""
    import torch
    input_ids = torch.as_tensor(ids, dtype=torch.long)
    mask = torch.ones_like(input_ids)

    def run() -> np.ndarray:
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        return out[:, ids.shape[1]:].numpy()

    return Recorder(run)


def load_hf(path: Path) -> tuple[Any, dict[str, Any]]:
    """(HF model in eval mode, float32, with all CPU threads; facts about it)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    facts = {"torch_version": torch.__version__, "transformers_version": transformers.__version__,
             "torch_threads": torch.get_num_threads(),
             "attn_implementation": getattr(model.config, "_attn_implementation", None),
             "experts_implementation": getattr(model.config, "_experts_implementation", None)}
    return model, facts


# ----------------------------------------------------------------------------------------------- measuring


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D token arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def rates(t_full: float, t_one: float, batch: int, new_tokens: int) -> dict[str, float | None]:
    """generate tok/s (prefill included), prefill time (the N = 1 call) and decode-only tok/s."""
    decode_s = t_full - t_one
    decode = batch * (new_tokens - 1) / decode_s if new_tokens > 1 and decode_s > 0 else None
    return {"time_s": t_full, "prefill_s": t_one, "generate_tok_s": batch * new_tokens / t_full,
            "decode_tok_s": decode}


def _mismatches(runners: dict[str, Recorder], names: list[str], new_tokens: int) -> int:
    """How many new tokens differ from the first tutel-jax variant's in any other (the same greedy program)."""
    first = runners[f"{names[0]}_{new_tokens}"].tokens
    return int(sum(np.sum(runners[f"{n}_{new_tokens}"].tokens != first) for n in names[1:]))


def bench_batch(s: Settings, batch: int, tutel_models: dict[str, Any], hf_model: Any | None) -> dict[str, Any]:
    """Every system at one batch size: timings, rates, agreement of the greedy tokens with HF.
    tutel_models: the model per dropless implementation; each runs in both modes (`tutel_<impl>_<mode>`)."""
    rng = np.random.default_rng(s.seed + batch)
    ids = rng.integers(1, s.model.vocab, size=(batch, s.prompt_len)).astype(np.int64)
    runners: dict[str, Recorder] = {}
    tutel_names = [f"tutel_{impl}_{mode}" for impl in tutel_models for mode in TUTEL_MODES]
    for impl, model in tutel_models.items():
        for mode in TUTEL_MODES:
            for n in (s.new_tokens, 1):
                runners[f"tutel_{impl}_{mode}_{n}"] = tutel_runner(model, ids, n, on_device=mode == "device")
    if hf_model is not None:
        for n in (s.new_tokens, 1):
            runners[f"hf_{n}"] = hf_runner(hf_model, ids, n)
    timings = time_interleaved(runners, s.repeats, warmup=1)
    systems = {}
    for name in tutel_names + (["hf"] if hf_model is not None else []):
        full, one = timings[f"{name}_{s.new_tokens}"], timings[f"{name}_1"]
        systems[name] = {**rates(full.min_s, one.min_s, batch, s.new_tokens),
                         "median_generate_tok_s": batch * s.new_tokens / full.median_s,
                         "first_call_s": full.first_call_s, "runs": full.runs,
                         "timing": full.as_dict(), "timing_n1": one.as_dict()}
    # per implementation its faster mode; the headline is the fastest variant
    best_by_impl = {impl: max((f"tutel_{impl}_{m}" for m in TUTEL_MODES), key=lambda n: systems[n]["generate_tok_s"])
                    for impl in tutel_models}
    best = max(best_by_impl.values(), key=lambda n: systems[n]["generate_tok_s"])
    row: dict[str, Any] = {"batch": batch, "tutel_best": best.removeprefix("tutel_"), "tutel": systems[best],
                           "tutel_by_impl": {impl: systems[n] for impl, n in best_by_impl.items()},
                           "systems": systems,
                           "token_mismatches_between_variants": _mismatches(runners, tutel_names, s.new_tokens)}
    if hf_model is not None:
        row["hf"] = systems["hf"]
        row["ratio_generate"] = row["tutel"]["generate_tok_s"] / row["hf"]["generate_tok_s"]
        row["ratio_decode"] = _ratio(row["tutel"]["decode_tok_s"], row["hf"]["decode_tok_s"])
        row["ratio_decode_by_impl"] = {impl: _ratio(t["decode_tok_s"], row["hf"]["decode_tok_s"])
                                       for impl, t in row["tutel_by_impl"].items()}
        ours, theirs = runners[f"{best}_{s.new_tokens}"].tokens, runners[f"hf_{s.new_tokens}"].tokens
        prefixes = [common_prefix(a, b) for a, b in zip(ours, theirs)]
        row["agreement"] = {"common_prefix_per_row": prefixes, "rows_identical": sum(p == s.new_tokens
                                                                                     for p in prefixes),
                            "new_tokens": s.new_tokens}
    return row


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


@contextlib.contextmanager
def checkpoint_dir(s: Settings, use_hf: bool) -> Iterator[tuple[Path, str]]:
    """A temporary folder holding the random checkpoint, and how it was made."""
    with tempfile.TemporaryDirectory(prefix="tutel_generate_bench_") as tmp:
        path = Path(tmp) / "qwen3_moe_random"
        if use_hf:
            write_hf_checkpoint(path, s.model, s.seed)
            yield path, "transformers Qwen3MoeForCausalLM.save_pretrained (torch.manual_seed)"
        else:
            write_numpy_checkpoint(path, s.model, s.seed)
            yield path, "NumPy (HF tensor names), safetensors"


def run(s: Settings, want_hf: bool = True) -> dict[str, Any]:
    """Builds the checkpoint, loads it into each system and measures every batch size."""
    import jax.numpy as jnp

    from tutel_jax.models import from_pretrained
    from tutel_jax.native import NativeKernelError
    skipped = "disabled with --no-hf" if not want_hf else hf_available()
    use_hf = skipped is None
    with checkpoint_dir(s, use_hf) as (path, made_by):
        loaded = from_pretrained(path, dtype=jnp.float32)
        tutel_models, unavailable = {}, {}
        for impl in s.dropless_impls:
            try:
                tutel_models[impl] = with_dropless_impl(loaded, impl)
            except NativeKernelError as e:  # no C++ compiler here: measure the others, say why
                unavailable[impl] = str(e)
                print(f"dropless_impl {impl!r} unavailable: {e}", file=sys.stderr)
        if not tutel_models:
            raise SystemExit(f"no dropless implementation can run here: {unavailable}")
        hf_model, hf_facts = load_hf(path) if use_hf else (None, {})
        num_params = int(sum(np.asarray(x).size for x in _leaves(loaded.params)))
        rows = []
        for batch in s.batches:
            row = bench_batch(s, batch, tutel_models, hf_model)
            rows.append(row)
            print(_progress_line(row), flush=True)
    return {"benchmark": "generate", "settings": _settings_dict(s), "num_params": num_params,
            "tutel_dropless_impls": {impl: _dropless_impl(m) for impl, m in tutel_models.items()},
            "unavailable_dropless_impls": unavailable,
            "checkpoint": made_by,
            "hf": {"skipped": skipped} if skipped else hf_facts,
            "machine": machine_info(), "results": rows}


def with_dropless_impl(model: Any, impl: str) -> Any:
    """The model with every MoE layer's `dropless_impl` set to `impl`; 'native' is checked (and built) here."""
    if impl == "native":
        from tutel_jax.experts import check_native
        for c in model.moe_configs:
            if c is not None:
                check_native(c.experts)
    configs = tuple(None if c is None else dataclasses.replace(c, dropless_impl=impl) for c in model.moe_configs)
    return dataclasses.replace(model, moe_configs=configs)


def _dropless_impl(model: Any) -> str | None:
    """The dropless implementation of the model's first MoE layer."""
    return next((c.dropless_impl for c in model.moe_configs if c is not None), None)


def _leaves(tree: Any) -> list[Any]:
    import jax
    return jax.tree_util.tree_leaves(tree)


def _settings_dict(s: Settings) -> dict[str, Any]:
    d = dataclasses.asdict(s)
    d["batches"] = list(s.batches)
    return d


def _progress_line(row: dict[str, Any]) -> str:
    t = row["tutel"]
    line = f"B={row['batch']:3d}  tutel-jax ({row['tutel_best']}) {t['generate_tok_s']:9.1f} tok/s"
    if "hf" in row:
        a = row["agreement"]
        line += (f"  HF {row['hf']['generate_tok_s']:9.1f} tok/s  ratio {row['ratio_generate']:.2f}x  "
                 f"greedy rows identical {a['rows_identical']}/{len(a['common_prefix_per_row'])}")
    return line


# ----------------------------------------------------------------------------------------------- report


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def markdown(result: dict[str, Any]) -> str:
    """The Markdown report: one row per batch size, then the setup."""
    s, m, info = result["settings"], result["settings"]["model"], result["machine"]
    has_hf = "skipped" not in result["hf"]
    impls = list(result["tutel_dropless_impls"])
    headers = ["batch", "tutel-jax tok/s", "variant", "HF tok/s", "ratio", "decode tok/s (tutel-jax / HF)",
               "decode ratio"] + [f"decode ratio, `{i}`" for i in impls] + ["prefill ms (tutel-jax / HF)",
                                                                               "greedy agreement"]
    rows = []
    for r in result["results"]:
        t, h = r["tutel"], r.get("hf")
        agree = "-"
        if has_hf:
            pre = r["agreement"]["common_prefix_per_row"]
            agree = (f"{r['agreement']['rows_identical']}/{len(pre)} rows; min prefix {min(pre)}/{s['new_tokens']}")
        per_impl = [fmt_ratio(r["ratio_decode_by_impl"][i]) if h and r["ratio_decode_by_impl"][i] else "-"
                    for i in impls]
        rows.append([r["batch"], _rate(t["generate_tok_s"]), r["tutel_best"],
                     _rate(h["generate_tok_s"]) if h else "skipped",
                     fmt_ratio(r["ratio_generate"]) if h else "-",
                     f"{_rate(t['decode_tok_s'])} / {_rate(h['decode_tok_s']) if h else '-'}",
                     fmt_ratio(r["ratio_decode"]) if h and r["ratio_decode"] else "-", *per_impl,
                     f"{fmt_ms(t['prefill_s'])} / {fmt_ms(h['prefill_s'])}" if h else fmt_ms(t["prefill_s"]),
                     agree])
    table = markdown_table(headers, rows, align="rrlrrrr" + "r" * len(impls) + "rl")
    variants = "; ".join(f"B={r['batch']}: " + ", ".join(f"{name.removeprefix('tutel_')} {_rate(v['generate_tok_s'])}"
                                                         for name, v in r["systems"].items() if name != "hf")
                         for r in result["results"])
    unavailable = "".join(f" `{i}` not measured: {why}." for i, why in result.get("unavailable_dropless_impls",
                                                                                     {}).items())
    hf_line = (f"HF skipped: {result['hf']['skipped']}." if not has_hf else
               f"HF: transformers {result['hf']['transformers_version']}, torch {result['hf']['torch_version']} "
               f"({result['hf']['torch_threads']} threads), attention `{result['hf']['attn_implementation']}`, "
               f"experts `{result['hf']['experts_implementation']}`, `generate(do_sample=False)` under "
               f"`torch.inference_mode()`.")
    return (f"# Greedy generation: tutel-jax vs HF transformers ({info['backend']})\n\n"
            f"`python benchmarks/generate.py`: random Qwen3-MoE model (hidden {m['hidden']}, {m['layers']} layers, "
            f"{m['experts']} experts, top-{m['top_k']}, moe_intermediate {m['moe_intermediate']}, {m['heads']} heads / "
            f"{m['kv_heads']} kv heads, head_dim {m['head_dim']}, vocab {m['vocab']}; "
            f"{result['num_params'] / 1e6:.1f}M "
            f"parameters, float32; checkpoint: {result['checkpoint']}), random prompts of {s['prompt_len']} tokens, "
            f"greedy, {s['new_tokens']} new tokens; best of {s['repeats']} interleaved runs after a warm-up "
            f"(compilation excluded). tok/s = batch x new tokens / wall time (prefill included); decode tok/s "
            f"takes out the prefill (the time of a 1-token call); ratio = tutel-jax / HF. tutel-jax runs with each "
            f"MoE implementation ({', '.join(f'`{i}`' for i in impls)}: dropless_impl, capacity_factor 0; "
            f"`auto` is the plain-XLA path, `native` the C++ CPU kernel) in two modes: a host loop over a jitted "
            f"decode step (`host`) and `generate(on_device=True)` (`device`); the variant column names the fastest, "
            f"whose figures the row shows; the per-implementation decode ratios use each one's faster mode."
            f"{unavailable} "
            f"{info['cpu_affinity']} CPU cores ({info['processor']}), jax {info['jax_version']}, {info['date']}.\n\n"
            + table + f"\n{hf_line}\n\ntutel-jax tok/s by variant: {variants}.\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=None, help=f"batch sizes (default {FULL.batches})")
    parser.add_argument("--prompt_len", type=int, default=None, help=f"prompt tokens (default {FULL.prompt_len})")
    parser.add_argument("--new_tokens", type=int, default=None, help=f"new tokens (default {FULL.new_tokens})")
    parser.add_argument("--repeats", type=int, default=None, help=f"timed runs per variant (default {FULL.repeats})")
    parser.add_argument("--seed", type=int, default=0)
    from tutel_jax.experts import IMPLS
    parser.add_argument("--dropless_impl", choices=IMPLS,
                        nargs="+", default=None,
                        help=f"the MoE implementations to measure tutel-jax with (default {FULL.dropless_impls})")
    parser.add_argument("--no-hf", dest="no_hf", action="store_true", help="measure tutel-jax alone")
    parser.add_argument("--quick", action="store_true", help="tiny model, batches 1 2, few tokens (smoke test)")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON output (default {DEFAULT_OUT}; quick: "
                                                               "generate_quick.json); the .md table next to it")
    parser.add_argument("--system-malloc", action="store_true", help="keep glibc's default malloc settings")
    args = parser.parse_args(argv)
    if not args.system_malloc:
        tune_malloc()
    base = QUICK if args.quick else FULL
    s = dataclasses.replace(base, seed=args.seed, **{k: v for k, v in (
        ("batches", tuple(args.batch) if args.batch else None), ("prompt_len", args.prompt_len),
        ("new_tokens", args.new_tokens), ("repeats", args.repeats),
        ("dropless_impls", tuple(dict.fromkeys(args.dropless_impl)) if args.dropless_impl else None))
        if v is not None})
    result = run(s, want_hf=not args.no_hf)
    result["quick"] = args.quick
    out = args.out or (DEFAULT_OUT.with_name("generate_quick.json") if args.quick else DEFAULT_OUT)
    write_json(out.with_suffix(".json"), result)
    text = markdown(result)
    write_text(out.with_suffix(".md"), text)
    print(text)
    return result


if __name__ == "__main__":
    main()
