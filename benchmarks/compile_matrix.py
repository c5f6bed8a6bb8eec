"""`tutel-jax compile` over a matrix of published MoE models and targets: memory per device, fit and roofline
floor of prefill and one decode step, compiled deviceless on a CPU host (jax >= 0.12).

    python benchmarks/compile_matrix.py                       # every model x every target
    python benchmarks/compile_matrix.py --models gpt-oss-20b --targets h100,v5p:2x2x2 --batch 8 --seq 4096

Writes benchmarks/results/compile_matrix.json (one `tutel-jax compile --json` report per cell, or the error)
and compile_matrix.md (a table). The configs are the models' published config.json values (the keys the
loader reads), written here so that no download is needed.
"""

from __future__ import annotations

import argparse
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


def _cell(model: str, target: str, batch: int, seq: int, mode: str) -> dict:
    import jax.numpy as jnp
    from tutel_jax.compile.driver import compile_model
    from tutel_jax.compile.topology import parse_target
    t0 = time.perf_counter()
    try:
        report = compile_model(MODELS[model], parse_target(target), batch, seq, mode, jnp.bfloat16)
    except Exception as e:  # a cell that fails is recorded, the matrix goes on
        return {"model": model, "target": target, "error": f"{type(e).__name__}: {e}"[:500],
                "seconds": round(time.perf_counter() - t0, 1)}
    for p in report["programs"]:
        p.pop("parts")  # per-program detail stays in the CLI's JSON; the matrix keeps the totals
    return {"model": model, "target": target, "report": report, "seconds": round(time.perf_counter() - t0, 1)}


def _markdown(cells: list[dict], batch: int, seq: int) -> str:
    rows = [f"Deviceless compile (tutel-jax compile), batch {batch}, seq {seq}; GiB per device; decode tok/s is "
            "the roofline ceiling batch / floor.", "",
            "| model | target | mesh | weights | prefill total | decode total | fits | decode floor ms | bound "
            "| decode tok/s | kernels (decode) | wall s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        if "error" in c:
            rows.append(f"| {c['model']} | {c['target']} | error: {c['error'][:120]} |||||||||{c['seconds']} |")
            continue
        r = c["report"]
        pre, dec = r["programs"]
        g = lambda n: f"{n / 2**30:.1f}"
        kern = ", ".join(f"{k} x{v}" for k, v in dec["kernels"].items()) or "none"
        rows.append(f"| {c['model']} | {c['target']} | {'x'.join(map(str, r['mesh']['axes'].values()))}"
                    f"{' (dense split)' if r['mesh']['dense_sharded'] else ''} | "
                    f"{g(dec['bytes_per_device']['weights'])} | {g(pre['bytes_per_device']['total'])} | "
                    f"{g(dec['bytes_per_device']['total'])} | {'yes' if pre['fits'] and dec['fits'] else 'no'} | "
                    f"{dec['roofline']['step_seconds_floor'] * 1e3:.2f} | {dec['roofline']['bound']} | "
                    f"{dec['roofline']['tokens_per_second_ceiling']:.0f} | {kern} | {c['seconds']} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated `tutel-jax compile` targets")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--out", default=str(RESULTS / "compile_matrix"), help="output path without extension")
    args = p.parse_args(argv)
    models, targets = args.models.split(","), args.targets.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"--models: unknown {unknown}; expected some of {list(MODELS)}")
    cells = []
    for model in models:
        for target in targets:
            cells.append(_cell(model, target, args.batch, args.seq, "serve"))
            print(f"{model} on {target}: {cells[-1].get('error', 'ok')} ({cells[-1]['seconds']} s)", file=sys.stderr)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(cells, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(_markdown(cells, args.batch, args.seq))
    return 0


if __name__ == "__main__":
    sys.exit(main())
