"""Real-shape HF checkpoints with random weights (no downloads), in the exact on-disk layout of the released ones.

    python benchmarks/make_real_size.py gpt-oss-20b            # -> <cache>/gpt-oss-20b/ (~13.8 GB)
    python benchmarks/make_real_size.py --list                 # the models, their shards and sizes

Models (`MODELS`): `gpt-oss-20b` (GPT-OSS-20B's config: MXFP4 experts, bf16 elsewhere), `qwen3-30b-a3b-half`
(Qwen3-30B-A3B's widths with 24 of its 48 layers, NVFP4 in the compressed-tensors layout), `deepseek-v3-layer`
(DeepSeek-V3's widths, 1 dense + 1 MoE layer, FP8 128x128 blocks), and a `-tiny` variant of each (the same
layout with small widths and depth, a few MB, for the smoke test). Tensor names, dtypes and shapes come from
`tutel_jax.models._quant_layout.checkpoint_layout` (checked there against the real quantizers' fixtures); shards
are `model-0000i-of-0000n.safetensors` of at most 5 GB plus `model.safetensors.index.json`, as save_pretrained
writes them.

Values: float weights N(0, initializer_range) (norms 1, biases 0); packed E2M1 bytes uniform; MXFP4 E8M0
exponents 118..121 (block scales 2^-9..2^-6, weights of about the trained models' size); FP8 e4m3 weights with
|w| < 2 (no NaN codes) and block scales in [0.01, 0.03]; NVFP4 e4m3 block scales in [1, 1.875] and a global
scale of 192. Each tensor draws from its own generator (seed, CRC of its name), so a shard is the same whenever
it is written. A byte-level tokenizer.json (ids 0..255, with a chat template) lets `tutel-jax serve` and
`generate` take text. Every shard is written to `.partial` and renamed when complete: an interrupted run resumes at
the first missing shard. The cache directory is `--cache-dir`, else `real_size` in tutel-jax's
user cache (`core.user_cache_dir`), outside the repository.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import zlib
from pathlib import Path
from typing import Any, BinaryIO

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tutel_jax.checkpoint import DTYPES  # noqa: E402
from tutel_jax.checkpoint import (HF_MAX_SHARD_BYTES, TensorInfo, plan_shards, shard_is_complete,
                                                    write_index, write_shard)
from tutel_jax.models import checkpoint_layout  # noqa: E402
from tutel_jax.lm import write_tokenizer  # noqa: E402

__all__ = ["MODELS", "default_cache_dir", "make_model", "model_bytes"]

_CHUNK = 1 << 24  # elements drawn and written at a time

GPT_OSS_20B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "dtype": "bfloat16",
    "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24, "num_local_experts": 32,
    "num_experts_per_tok": 4, "experts_per_token": 4, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "vocab_size": 201088, "attention_bias": True, "attention_dropout": 0.0, "hidden_act": "silu",
    "initial_context_length": 4096, "initializer_range": 0.02, "max_position_embeddings": 131072,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "sliding_window": 128,
    "rope_parameters": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                        "rope_theta": 150000.0, "rope_type": "yarn", "truncate": False},
    "rms_norm_eps": 1e-05, "router_aux_loss_coef": 0.9, "output_router_logits": False, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "eos_token_id": 200002, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
}

_NVFP4_GROUP = {"format": "nvfp4-pack-quantized", "input_activations": None, "output_activations": None,
                "targets": ["Linear"],
                "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 16,
                            "num_bits": 4, "observer": "memoryless_minmax", "observer_kwargs": {},
                            "scale_dtype": "torch.float8_e4m3fn", "strategy": "tensor_group", "symmetric": True,
                            "type": "float", "zp_dtype": None}}


def _nvfp4_config(layers: int) -> dict[str, Any]:
    """compressed-tensors' quantization_config of an NVFP4 Qwen3-MoE (routers and lm_head left in bf16)."""
    return {"config_groups": {"group_0": _NVFP4_GROUP}, "format": "nvfp4-pack-quantized",
            "global_compression_ratio": None, "ignore": [f"model.layers.{i}.mlp.gate" for i in range(layers)] + ["lm_head"],
            "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "sparsity_config": {}, "transform_config": {}, "version": "0.19.0"}


QWEN3_30B_A3B_HALF: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "dtype": "bfloat16",
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 24,
    "num_experts": 128, "num_local_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
    "attention_bias": False, "attention_dropout": 0.0, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "router_aux_loss_coef": 0.001,
    "output_router_logits": False, "sliding_window": None, "use_sliding_window": False,
    "tie_word_embeddings": False, "use_cache": True, "bos_token_id": 151643, "eos_token_id": 151645,
    "quantization_config": _nvfp4_config(24),
}

DEEPSEEK_V3_LAYER: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "dtype": "bfloat16",
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 2,
    "first_k_dense_replace": 1, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "qk_head_dim": 192, "head_dim": 64, "v_head_dim": 128,
    "vocab_size": 129280, "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
    "initializer_range": 0.02, "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_interleave": True,
    "rope_parameters": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                        "original_max_position_embeddings": 4096, "rope_theta": 10000.0, "rope_type": "yarn"},
    "num_nextn_predict_layers": 0, "pretraining_tp": 1, "tie_word_embeddings": False, "use_cache": True,
    "bos_token_id": 0, "eos_token_id": 1,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}


def _tiny(config: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**config, **changes}


MODELS: dict[str, dict[str, Any]] = {
    "gpt-oss-20b": GPT_OSS_20B,
    "qwen3-30b-a3b-half": QWEN3_30B_A3B_HALF,
    "deepseek-v3-layer": DEEPSEEK_V3_LAYER,
    "gpt-oss-20b-tiny": _tiny(GPT_OSS_20B, hidden_size=128, intermediate_size=128, num_hidden_layers=4,
                              num_local_experts=8, num_experts_per_tok=2, experts_per_token=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=32, vocab_size=512, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"] * 2),
    "qwen3-30b-a3b-half-tiny": _tiny(QWEN3_30B_A3B_HALF, hidden_size=128, intermediate_size=256,
                                     moe_intermediate_size=64, num_hidden_layers=2, num_experts=16,
                                     num_local_experts=16, num_experts_per_tok=4, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=32, vocab_size=512,
                                     quantization_config=_nvfp4_config(2)),
    "deepseek-v3-layer-tiny": _tiny(DEEPSEEK_V3_LAYER, hidden_size=256, intermediate_size=512,
                                    moe_intermediate_size=128, n_routed_experts=16, num_experts_per_tok=4,
                                    n_group=4, topk_group=2, num_attention_heads=4, num_key_value_heads=4,
                                    q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                                    qk_head_dim=32, head_dim=16, v_head_dim=16, vocab_size=512),
}


def default_cache_dir() -> Path:
    """--cache-dir's default: real_size in tutel-jax's user cache (`core.user_cache_dir`: $TUTEL_JAX_CACHE, else
    $XDG_CACHE_HOME/tutel_jax, else ~/.cache/tutel_jax)."""
    from tutel_jax.core import user_cache_dir

    return user_cache_dir() / "real_size"


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _draw(role: str, info: TensorInfo, n: int, rng: np.random.Generator, std: float) -> np.ndarray:
    """n values of the tensor `info` with this role (module docstring), in its on-disk dtype."""
    dtype = DTYPES[info.dtype]
    if role == "normal":
        return (rng.standard_normal(n, dtype=np.float32) * np.float32(std)).astype(dtype)
    if role in ("ones", "zeros"):
        return (np.ones if role == "ones" else np.zeros)(n, dtype)
    if role == "fp4":
        return rng.integers(0, 256, n, dtype=np.uint8)
    if role == "e8m0":
        return rng.integers(118, 122, n, dtype=np.uint8)
    if role == "fp8":  # exponent field <= 0b0111: |w| < 2, never the NaN code S.1111.111
        return (rng.integers(0, 256, n, dtype=np.uint8) & np.uint8(0xBF)).view(ml_dtypes.float8_e4m3fn)
    if role == "e4m3_scale":  # 0x38..0x3F: 1.0 .. 1.875
        return (np.uint8(0x38) | rng.integers(0, 8, n, dtype=np.uint8)).view(ml_dtypes.float8_e4m3fn)
    if role == "scale_inv":
        return rng.uniform(0.01, 0.03, n).astype(np.float32)
    if role == "global_scale":
        return np.full(n, 192.0, np.float32)
    if role == "int8":  # per-channel int8 codes
        return rng.integers(-127, 128, n, dtype=np.int8)
    if role == "channel_scale":  # int8 codes x ~1/2000: about N(0, 0.03) weights
        return rng.uniform(3e-4, 6e-4, n).astype(dtype)
    raise ValueError(f"tensor {info.name!r}: unknown role {role!r}")


def _fill(roles: dict[str, str], seed: int, std: float, bar) -> Any:
    def fill(info: TensorInfo, f: BinaryIO) -> None:
        rng, total = _rng(seed, info.name), info.nbytes // DTYPES[info.dtype].itemsize
        for start in range(0, total, _CHUNK):
            values = _draw(roles[info.name], info, min(_CHUNK, total - start), rng, std)
            f.write(values.tobytes())
            bar.update(values.nbytes)
    return fill


def model_bytes(name: str) -> int:
    """The bytes of model `name`'s shards (headers included)."""
    return sum(s.file_bytes() for s in plan_shards([t for t, _ in checkpoint_layout(MODELS[name])]))


def make_model(name: str, cache_dir: str | os.PathLike | None = None, *, seed: int = 0,
               max_shard_bytes: int = HF_MAX_SHARD_BYTES, progress: bool = True) -> Path:
    """Writes (or completes) model `name` under `cache_dir / name` and returns that directory: config.json,
    generation_config.json, a byte-level tokenizer (`tutel_jax.lm._byte_tokenizer`), the shards and, for several
    shards, the index. Shards already complete are kept."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    from tqdm.auto import tqdm

    config = MODELS[name]
    out = Path(cache_dir or default_cache_dir()) / name
    out.mkdir(parents=True, exist_ok=True)
    layout = checkpoint_layout(config)
    roles = {t.name: role for t, role in layout}
    shards = plan_shards([t for t, _ in layout], max_shard_bytes)
    total = sum(s.file_bytes() for s in shards)
    with tqdm(total=total, unit="B", unit_scale=True, desc=name, disable=not progress) as bar:
        fill = _fill(roles, seed, float(config.get("initializer_range", 0.02)), bar)
        for shard in shards:
            path = out / shard.filename
            if shard_is_complete(path, shard):
                bar.update(shard.file_bytes())
                continue
            write_shard(path, shard, fill)
            bar.update(len(shard.header()))
    write_index(out, shards)
    # a tokenizer for the server and `generate`: byte-level ids 0..255 (+ a plain-text chat template); the
    # random model answers with any of its ids, the ones past 255 decode to nothing
    write_tokenizer(out, model_max_length=int(config.get("max_position_embeddings", 4096)))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")  # last: the model is complete
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="*", help=f"any of {sorted(MODELS)}")
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: %s" % default_cache_dir())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--list", action="store_true", help="print the models and their sizes")
    args = parser.parse_args(argv)
    if args.list or not args.models:
        for name in MODELS:
            shards = plan_shards([t for t, _ in checkpoint_layout(MODELS[name])])
            print(f"{name:26s} {model_bytes(name) / 1e9:7.3f} GB in {len(shards)} shard(s)")
        return 0
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known: {sorted(MODELS)}")
    for name in args.models:
        print(make_model(name, args.cache_dir, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
