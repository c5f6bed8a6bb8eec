"""`tutel-jax compile` over a matrix of published MoE models and targets: memory per device, fit, the kernels
inside and the analytic roofline of prefill and one decode step, compiled deviceless on a CPU host (jax >= 0.12).

    python benchmarks/compile_matrix.py                       # every model x every target, serve mode
    python benchmarks/compile_matrix.py --models gpt-oss-20b --targets h100,v5p:2x2x2 --batch 8 --seq 4096
    python benchmarks/compile_matrix.py --mode train --models gpt-oss-20b --targets h200x8 --batch 1 --seq 4096

Each cell compiles the serving prefill + decode programs at --batch x --seq (memory, fit, kernels) and adds the
analytic decode roofline at batch 1 with the same --seq cached positions (the headline: a floor on one
token's latency, `tutel_jax.compile._roofline`; nothing is compiled for it). Writes
benchmarks/results/compile_matrix.json (one `tutel-jax compile --json` report per cell, less the per-part
detail, or the error) and compile_matrix.md (the table, the run's scope and the published figures to compare
with). The configs are the models' published config.json values (the keys the loader reads), written here so
that no download is needed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"

_YARN_GPT_OSS = {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                 "rope_type": "yarn", "truncate": False}


def _gpt_oss(layers: int, experts: int) -> dict:
    return {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "attention_bias": True,
            "head_dim": 64, "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64,
            "num_key_value_heads": 8, "num_hidden_layers": layers, "num_local_experts": experts,
            "num_experts_per_tok": 4, "experts_per_token": 4,
            "layer_types": ["sliding_attention", "full_attention"] * (layers // 2), "sliding_window": 128,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 150000,
            "rope_scaling": dict(_YARN_GPT_OSS), "swiglu_limit": 7.0, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "vocab_size": 201088, "initializer_range": 0.02,
            "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}


def _qwen3(hidden: int, layers: int, heads: int, moe_inter: int, inter: int) -> dict:
    return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 4, "head_dim": 128,
            "moe_intermediate_size": moe_inter, "intermediate_size": inter, "num_experts": 128,
            "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "max_position_embeddings": 40960,
            "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "use_sliding_window": False, "sliding_window": None}


MODELS = {
    "Qwen3-30B-A3B": _qwen3(2048, 48, 32, 768, 6144),
    "Qwen3-235B-A22B": _qwen3(4096, 94, 64, 1536, 12288),
    "Mixtral-8x7B": {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 4096,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
                     "vocab_size": 32000, "rope_theta": 1000000.0, "rms_norm_eps": 1e-05,
                     "max_position_embeddings": 32768, "sliding_window": None, "tie_word_embeddings": False,
                     "torch_dtype": "bfloat16"},
    "DeepSeek-V3": {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168,
                    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
                    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                    "v_head_dim": 128, "moe_intermediate_size": 2048, "intermediate_size": 18432,
                    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8,
                    "topk_group": 4, "first_k_dense_replace": 3, "moe_layer_freq": 1, "routed_scaling_factor": 2.5,
                    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
                    "vocab_size": 129280, "rope_theta": 10000, "rms_norm_eps": 1e-06,
                    "max_position_embeddings": 163840,
                    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                     "type": "yarn"},
                    "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                            "weight_block_size": [128, 128]}},
    "gpt-oss-20b": _gpt_oss(24, 32),
    "gpt-oss-120b": _gpt_oss(36, 128),
}
TARGETS = ("a100-80gb", "h100", "h200x8", "b200x8", "v5e:2x4", "v5p:2x2x2")
RESULTS = Path(__file__).resolve().parent / "results"
#: the decode batch of the headline floor
HEADLINE_BATCH = 1

#: published decode speeds users compare with: other projects' claims, not measured here
PUBLISHED = (
    {"model": "gpt-oss-120b", "target": "a100-80gb", "system": "Tutel (MXFP4)", "tokens_per_second": 212.0,
     "batch": 1, "source": "microsoft/Tutel README, table 'Inference TPOS' (gpt-oss-120b, A100 x 1, mxfp4; "
                           "SGL 127 in the same row; the A100 size is not stated: the 63 GB model needs the 80 GB "
                           "one)"},
    {"model": "gpt-oss-120b", "target": "h100", "system": "SGLang (MXFP4)", "tokens_per_second": 318.53,
     "batch": 1, "source": "LMSYS blog 'SGLang for gpt-oss: From Day 0 Support to Enhanced Performance', "
                           "2025-08-27, low-latency table (batch size 1, H100, MXFP4)"},
)


#: what tokamax's Mosaic GPU ragged_dot (the default grouped matmul for bf16 / FP8 experts on sm_90 / sm_100
#: where tokamax is installed) raises when traced inside the expert-parallel shard_map
_MOSAIC_GPU_SHARD_MAP_ERRORS = ("requires varying manual axes to match", "mpmd_map does not support Refs")
#: the retry of such a cell: every op's Triton kernel (what "auto" picks without tokamax)
TRITON_KERNELS = {"TUTEL_JAX_KERNELS": "pallas"}


def _compile_cell(model: str, target: str, batch: int, seq: int, mode: str) -> dict:
    import jax.numpy as jnp
    from tutel_jax.compile import compile_model
    from tutel_jax.compile import parse_target
    report = compile_model(MODELS[model], parse_target(target), batch, seq, mode, jnp.bfloat16,
                           decode_batches=(HEADLINE_BATCH,) if mode == "serve" else ())
    for p in report["programs"]:
        p.pop("parts")  # per-program detail stays in the CLI's JSON; the matrix keeps the totals
    return report


def _cell(model: str, target: str, batch: int, seq: int, mode: str) -> dict:
    """One cell: the report, or the error; a GPU cell whose default kernels fail in tokamax's Mosaic GPU
    ragged_dot is compiled again with the Triton kernels (`TRITON_KERNELS`), both recorded."""
    t0 = time.perf_counter()
    cell = {"model": model, "target": target, "mode": mode, "kernels_env": None}
    try:
        cell["report"] = _compile_cell(model, target, batch, seq, mode)
    except Exception as e:  # a cell that fails is recorded, the matrix goes on
        cell["error"] = f"{type(e).__name__}: {e}"[:500]
    if "error" in cell and any(m in cell["error"] for m in _MOSAIC_GPU_SHARD_MAP_ERRORS):
        saved = {k: os.environ.get(k) for k in TRITON_KERNELS}
        os.environ.update(TRITON_KERNELS)
        try:
            cell["report"] = _compile_cell(model, target, batch, seq, mode)
            cell["default_kernels_error"] = cell.pop("error")
            cell["kernels_env"] = " ".join(f"{k}={v}" for k, v in TRITON_KERNELS.items())
        except Exception as e:
            cell["triton_retry_error"] = f"{type(e).__name__}: {e}"[:500]
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    cell["seconds"] = round(time.perf_counter() - t0, 1)
    return cell


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def _kernels(program: dict) -> str:
    return ", ".join(f"{k} x{v}" for k, v in program["kernels"].items()) or "none"


def _serve_rows(cells: list[dict]) -> list[str]:
    rows = ["| model | target | mesh | weights | prefill total | decode total | fits | decode b1 floor ms "
            "| b1 tok/s ceiling | b1 GB read | decode bN tok/s ceiling (bound) | XLA-cost decode bN ms (ref.) "
            "| kernels in decode (calls per step) | wall s |",
            "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---:|"]
    for c in cells:
        if "error" in c:
            rows.append(f"| {c['model']} | {c['target']} | error: {c['error'][:160]} ||||||||||| {c['seconds']} |")
            continue
        r = c["report"]
        pre, dec = r["programs"]
        b1 = r["decode_rooflines"][str(HEADLINE_BATCH)]
        rl, x = dec["roofline"], dec["xla_cost"]
        mesh = "x".join(map(str, r["mesh"]["axes"].values())) + (" (dense split)" if r["mesh"]["dense_sharded"] else "")
        refused = [p["program"] for p in (pre, dec) if p["compile_errors"]]
        fits = "yes" if pre["fits"] and dec["fits"] else "no" + (f" ({' + '.join(refused)} refused by XLA)" if refused else "")
        xla = "-" if x["step_seconds"] is None else f"{x['step_seconds'] * 1e3:.3g}"
        if c["kernels_env"]:
            mesh += " †"
        rows.append(f"| {c['model']} | {c['target']} | {mesh} | {_gib(dec['bytes_per_device']['weights'])} | "
                    f"{_gib(pre['bytes_per_device']['total'])} | {_gib(dec['bytes_per_device']['total'])} | "
                    f"{fits} | {b1['step_seconds_floor'] * 1e3:.2f} | "
                    f"{b1['tokens_per_second_ceiling']:,.0f} | {b1['bytes'] / 1e9:.2f} | "
                    f"{rl['tokens_per_second_ceiling']:,.0f} ({rl['bound']}) | {xla} | "
                    f"{_kernels(dec)} | {c['seconds']} |")
    return rows


def _train_rows(cells: list[dict]) -> list[str]:
    rows = ["| model | target | mesh | weights | optimizer | act + temps | total | fits | step floor ms (bound) "
            "| tok/s ceiling | kernels (calls per step) | wall s |", "|---|---|---|---:|---:|---:|---:|---|---:|---:|---|---:|"]
    for c in cells:
        if "error" in c:
            rows.append(f"| {c['model']} | {c['target']} | error: {c['error'][:160]} ||||||||| {c['seconds']} |")
            continue
        r = c["report"]
        (t,) = r["programs"]
        b, rl = t["bytes_per_device"], t["roofline"]
        mesh = "x".join(map(str, r["mesh"]["axes"].values())) + (" (dense split)" if r["mesh"]["dense_sharded"] else "")
        fits = "yes" if t["fits"] else "no" + (" (refused by XLA)" if t["compile_errors"] else "")
        if c["kernels_env"]:
            mesh += " †"
        rows.append(f"| {c['model']} | {c['target']} | {mesh} | {_gib(b['weights'])} | {_gib(b['optimizer'])} | "
                    f"{_gib(b['activations_and_temps'])} | {_gib(b['total'])} | {fits} | "
                    f"{rl['step_seconds_floor'] * 1e3:,.1f} ({rl['bound']}) | {rl['tokens_per_second_ceiling']:,.0f} | "
                    f"{_kernels(t)} | {c['seconds']} |")
    return rows


def _published_rows(cells: list[dict]) -> list[str]:
    rows = ["| model | target | system | published tok/s (batch 1) | our b1 ceiling tok/s | published / ceiling "
            "| source |", "|---|---|---|---:|---:|---:|---|"]
    for pub in PUBLISHED:
        match = [c for c in cells if c["model"] == pub["model"] and c["target"] == pub["target"]
                 and c["mode"] == "serve" and "report" in c]
        if match:
            ceiling = match[0]["report"]["decode_rooflines"][str(HEADLINE_BATCH)]["tokens_per_second_ceiling"]
            ours, ratio = f"{ceiling:,.0f}", f"{pub['tokens_per_second'] / ceiling:.0%}"
        else:
            ours, ratio = "not run", "-"
        rows.append(f"| {pub['model']} | {pub['target']} | {pub['system']} | {pub['tokens_per_second']:g} | {ours} | "
                    f"{ratio} | {pub['source']} |")
    return rows


def _markdown(cells: list[dict], run: dict) -> str:
    serve = [c for c in cells if c["mode"] == "serve"]
    train = [c for c in cells if c["mode"] == "train"]
    out = [f"Deviceless compiles (`tutel-jax compile`, jax {run['jax']}, {run['date']}) on a {run['host']}; "
           f"{len(cells)} cells in {run['wall_seconds'] / 60:.1f} min of wall time.", "",
           "Figures are per device. Memory (GiB) is XLA's memory analysis of the compiled programs plus the resident "
           "weights / KV cache / optimizer state; floors and tok/s ceilings are the analytic roofline "
           "(`tutel_jax/compile/_roofline.py`: flops and HBM bytes the step cannot avoid, from the config and the "
           "weights' shapes; floor = max(flops / peak bf16, bytes / HBM bandwidth)), an upper bound on speed, "
           "not a measurement. XLA's own cost analysis is kept as a reference column: on GPU it is the host's HLO "
           "cost analysis, which gives the Triton kernels (custom calls) no flops and does not see what they read; "
           "on TPU its bytes are no HBM floor.", ""]
    if serve:
        out += [f"## Serving: memory at batch {run['serve_batch']} x seq {run['serve_seq']}, decode floor at batch "
                f"{HEADLINE_BATCH} (headline) and batch {run['serve_batch']}", "",
                f"b1: one decode step of one row against {run['serve_seq']} cached positions; bN: batch "
                f"{run['serve_batch']}. GB read: HBM bytes the b1 step reads per device (weights in their stored "
                "format, the routed experts one token can touch, KV cache).", ""]
        out += _serve_rows(serve) + [""]
        out += ["## Published figures to compare with (their claims, not measured here)", "",
                "A measured decode speed can only approach the ceiling: the ratio is how much of the HBM-bandwidth "
                "floor the published system reaches.", ""]
        out += _published_rows(serve) + [""]
    if train:
        out += [f"## Training: batch {run['train_batch']} x seq {run['train_seq']}", "",
                "Quantized checkpoints train their dequantized bf16 weights; AdamW moments in bf16 (optax's default: "
                "the weights' dtype). The floor is 3x the forward's flops (the programs' block rematerialization "
                "adds a second forward, not counted).", ""]
        out += _train_rows(train) + [""]
    retried = [c for c in cells if c.get("kernels_env")]
    if retried:
        errors = sorted({c["default_kernels_error"].split(". Please")[0].split(": in_avals")[0] for c in retried})
        out += ["† compiled with " + retried[0]["kernels_env"] + " (the Triton grouped matmul, now what 'auto' "
                "picks on every GPU). When this run was made, 'auto' tried tokamax's Mosaic GPU ragged_dot first on "
                "sm_90 / sm_100, and it fails to trace inside the expert-parallel shard_map: "
                + "; ".join(f"`{e}`" for e in errors) + ". `implementation='mosaic_gpu'` is asked for by name "
                "only since (see pallas_kernels/_select.py).", ""]
    out += ["## Scope of this run", "", run["scope"], ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated `tutel-jax compile` targets")
    p.add_argument("--mode", choices=("serve", "train", "both"), default="serve")
    p.add_argument("--batch", type=int, default=8, help="serving: rows of the compiled prefill / decode")
    p.add_argument("--seq", type=int, default=4096, help="serving: prompt tokens / KV cache slots")
    p.add_argument("--train-batch", type=int, default=1)
    p.add_argument("--train-seq", type=int, default=4096)
    p.add_argument("--train-models", default=None, help="models of the train cells (default: --models)")
    p.add_argument("--train-targets", default=None, help="targets of the train cells (default: --targets)")
    p.add_argument("--scope", default="", help="a sentence recorded in the results: what was run and what was cut")
    p.add_argument("--out", default=str(RESULTS / "compile_matrix"), help="output path without extension")
    p.add_argument("--render-only", action="store_true",
                   help="compile nothing: write OUT.md again from OUT.json (with --scope, replacing its scope)")
    args = p.parse_args(argv)
    if args.render_only:
        out = Path(args.out)
        data = json.loads(out.with_suffix(".json").read_text())
        data["published"] = PUBLISHED
        if args.scope:
            data["run"]["scope"] = args.scope
        out.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str) + "\n")
        out.with_suffix(".md").write_text(_markdown(data["cells"], data["run"]))
        return 0
    models, targets = args.models.split(","), args.targets.split(",")
    train_models = args.train_models.split(",") if args.train_models else models
    train_targets = args.train_targets.split(",") if args.train_targets else targets
    unknown = [m for m in models + train_models if m not in MODELS]
    if unknown:
        p.error(f"--models: unknown {unknown}; expected some of {list(MODELS)}")
    import jax
    t0 = time.perf_counter()
    plan = []
    if args.mode in ("serve", "both"):
        plan += [(m, t, args.batch, args.seq, "serve") for m in models for t in targets]
    if args.mode in ("train", "both"):
        plan += [(m, t, args.train_batch, args.train_seq, "train") for m in train_models for t in train_targets]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    scope = args.scope or f"mode {args.mode}: {len(plan)} cells ({', '.join(models)} x {', '.join(targets)})"

    def write(cells: list[dict]) -> None:  # after every cell: a run cut short keeps what it measured
        run = {"jax": jax.__version__, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
               "host": f"{os.cpu_count()}-CPU host", "wall_seconds": round(time.perf_counter() - t0, 1),
               "serve_batch": args.batch, "serve_seq": args.seq, "train_batch": args.train_batch,
               "train_seq": args.train_seq, "headline_decode_batch": HEADLINE_BATCH,
               "cells_planned": len(plan), "cells_done": len(cells),
               "scope": scope + ("" if len(cells) == len(plan) else f" (in progress: {len(cells)} of {len(plan)})")}
        out.with_suffix(".json").write_text(json.dumps({"run": run, "published": PUBLISHED, "cells": cells},
                                                       indent=1, default=str) + "\n")
        out.with_suffix(".md").write_text(_markdown(cells, run))

    cells = []
    for model, target, batch, seq, mode in plan:
        cells.append(_cell(model, target, batch, seq, mode))
        print(f"{mode} {model} on {target}: {cells[-1].get('error', 'ok')} ({cells[-1]['seconds']} s)",
              file=sys.stderr, flush=True)
        write(cells)
    return 0


if __name__ == "__main__":
    sys.exit(main())
