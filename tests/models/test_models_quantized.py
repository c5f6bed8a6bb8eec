"""Quantized checkpoints kept packed in memory: the loaded parameters hold the FP8 / MXFP4 / NVFP4 bytes (never
the float weights), the matmuls dequantize inside and reproduce the HF logits (fixtures, tolerance as in
test_models_hf: 1e-4) and the dequantize-at-load reference (float32, 1e-5 relative); resident expert bytes
against bf16; the quantized expert / shared-expert layers against float layers on the dequantized weights."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tutel_jax.quant import _weights as quant_weights
from tutel_jax.layer import make_config, init_params, moe_apply
from tutel_jax.models import from_pretrained, memory_report, QuantizedTensors
from support.paths import HF
from support.exact_paths import FLOAT_ACTIVATIONS
from support.channel_checkpoint import write_channel_copy

QUANT_CASES = {"deepseek_v3_fp8": "fp8_block", "gpt_oss_mxfp4": "mxfp4", "qwen3_moe_nvfp4": "nvfp4"}
PACKED_DTYPES = {"uint8", "float8_e4m3fn"}
_MODELS: dict = {}


def _load(case):
    if case not in _MODELS:
        _MODELS[case] = from_pretrained(HF / case, **FLOAT_ACTIVATIONS)
    return _MODELS[case]


@pytest.mark.parametrize("case", sorted(QUANT_CASES))
def test_expert_weights_stay_packed(case):
    model = _load(case)
    for layer in model.params["layers"]:
        if "moe" not in layer:
            continue
        experts = layer["moe"]["experts"]
        weights = [w for w in jax.tree_util.tree_leaves(experts, is_leaf=quant_weights.is_quantized)
                   if quant_weights.is_quantized(w)]
        assert weights and all(w.format == QUANT_CASES[case] for w in weights)
        for w in weights:  # the values are packed bytes; the float32 scales are few
            values = jax.tree_util.tree_leaves(w)[0]
            assert values.dtype.name in PACKED_DTYPES, values.dtype
            for leaf in jax.tree_util.tree_leaves(w):
                if leaf.dtype.itemsize > 1:
                    assert leaf.size * 16 <= math.prod(w.shape), "a float copy of the weight is resident"


@pytest.mark.parametrize("case", sorted(QUANT_CASES))
def test_quantized_logits_match_fixture_and_dequantized_reference(case):
    model = _load(case)
    e = np.load(HF / case / "expected.npz")
    got = np.asarray(model(e["input_ids"]))
    np.testing.assert_allclose(got, e["logits"], rtol=1e-4, atol=1e-4)
    ref = np.asarray(from_pretrained(HF / case, dequantize=True)(e["input_ids"]))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("case,limit", [("deepseek_v3_fp8", 0.55), ("gpt_oss_mxfp4", 0.30),
                                        ("qwen3_moe_nvfp4", 0.30)])
def test_memory_report_against_bf16(case, limit):
    report = memory_report(_load(case))
    assert report.expert_ratio <= limit, str(report)
    float_report = memory_report(from_pretrained(HF / case, dequantize=True))
    assert float_report.expert_bf16_bytes == report.expert_bf16_bytes  # same logical weights
    assert float_report.expert_ratio == pytest.approx(2.0, rel=1e-6)  # float32 = 2 x bf16
    assert str(report).startswith("expert weights")


@pytest.mark.parametrize("fmt,limit", [("fp8_block", 0.51), ("mxfp4", 0.27), ("nvfp4", 0.29), ("int8", 0.51),
                                       ("fp8_channel", 0.51)])
def test_resident_bytes_of_a_realistic_expert_stack(fmt, limit):
    """[E=4, 1536, 1024] experts: FP8 1 byte + a float32 per 128x128 block; FP4 half a byte + its scales."""
    w = quant_weights.quantize(jax.random.normal(jax.random.key(0), (4, 1536, 1024)), fmt)
    ratio = quant_weights.resident_bytes(w) / (2 * math.prod(w.shape))
    assert ratio <= limit and ratio >= 0.25


def _float_twin(config_q, params_q):
    """A float 'swiglu' layer holding the dequantized weights of a quantized one."""
    experts = {"type": "swiglu", "count_per_node": config_q.num_global_experts,
               "hidden_size_per_expert": config_q.experts.hidden_size_per_expert}
    params = {"gates": params_q["gates"],
              "experts": {n: quant_weights.dequantize(w) for n, w in params_q["experts"].items()}}
    if "shared_experts" in params_q:
        s = params_q["shared_experts"]
        experts["shared"] = {"hidden_size": config_q.shared_experts.hidden_size}
        params["shared_experts"] = {n: quant_weights.dequantize(s[n]) for n in s}
    return make_config({"type": "top", "k": 2}, config_q.model_dim, experts), params


@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp4", "nvfp4", "int8", "fp8_channel"])
@pytest.mark.parametrize("cf,impl", [(0.0, "ragged"), (0.0, "bucketed"), (1.0, "ragged")])
def test_quantized_swiglu_layer_equals_float_layer_on_dequantized_weights(fmt, cf, impl):
    experts = {"type": "swiglu", "count_per_node": 4, "hidden_size_per_expert": 64, "weight_format": fmt,
               "shared": {"hidden_size": 32, "weight_format": fmt}}
    config = make_config({"type": "top", "k": 2}, 64, experts, dropless_impl=impl)
    params = init_params(config, jax.random.key(1))
    assert params["experts"]["gate_proj"].format == fmt and params["shared_experts"]["down_proj"].format == fmt
    x = jax.random.normal(jax.random.key(2), (24, 64))
    y, _ = moe_apply(params, x, config, capacity_factor=cf)
    config_f, params_f = _float_twin(config, params)
    y_ref, _ = moe_apply(params_f, x, config_f, capacity_factor=cf)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)


def test_quantized_experts_through_the_interpreted_kernel():
    """kernel_backend='interpret': the Pallas grouped quantized matmul (CPU interpreter) == the XLA path."""
    experts = {"type": "swiglu", "count_per_node": 4, "hidden_size_per_expert": 128, "weight_format": "mxfp4"}
    x = jax.random.normal(jax.random.key(3), (16, 128))
    outs = []
    for backend in ("xla", "interpret"):
        config = make_config({"type": "top", "k": 2}, 128, experts, kernel_backend=backend)
        params = init_params(config, jax.random.key(4))
        outs.append(np.asarray(moe_apply(params, x, config, capacity_factor=0.0)[0]))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_bad_quantized_tensors_name_the_tensor():
    base = "model.layers.0.mlp.experts.0.gate_proj.weight"
    good = {base + "_packed": np.zeros((4, 8), np.uint8), base + "_scale": np.zeros((4, 1), np.float32),
            base + "_global_scale": np.ones((1,), np.float32)}
    assert QuantizedTensors(good)[base].shape == (4, 16)
    bad = dict(good, **{base + "_scale": np.zeros((4, 3), np.float32)})
    with pytest.raises(ValueError, match=f"tensor '{base}'.*weight_scale shape"):
        QuantizedTensors(bad)[base]
    missing = {k: v for k, v in good.items() if not k.endswith("_global_scale")}
    with pytest.raises(ValueError, match="lacks"):
        QuantizedTensors(missing)
    with pytest.raises(ValueError, match="weight_format"):
        make_config({"type": "top", "k": 1}, 8, {"type": "swiglu", "count_per_node": 2,
                                                 "hidden_size_per_expert": 8, "weight_format": "int4"})


def _as_modelopt(src: Path, dst: Path) -> Path:
    """The compressed-tensors NVFP4 fixture rewritten in ModelOpt's layout: X.weight (packed), X.weight_scale,
    X.weight_scale_2 = 1 / global_scale (multiplies), X.input_scale."""
    import json

    from safetensors.numpy import save_file

    from tutel_jax.checkpoint import open_checkpoint

    dst.mkdir()
    out = {}
    with open_checkpoint(src) as ckpt:
        for name in ckpt:
            a = ckpt[name]
            if name.endswith(".weight_packed"):
                out[name[: -len("_packed")]] = a
            elif name.endswith(".weight_global_scale"):
                base = name[: -len("weight_global_scale")]
                out[base + "weight_scale_2"] = (np.float32(1.0) / a.astype(np.float32)).reshape(())
                out[base + "input_scale"] = np.ones((), np.float32)
            else:
                out[name] = a
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_modelopt_nvfp4_checkpoint(tmp_path):
    d = _as_modelopt(HF / "qwen3_moe_nvfp4", tmp_path / "modelopt")
    model = from_pretrained(d, **FLOAT_ACTIVATIONS)
    experts = model.params["layers"][0]["moe"]["experts"]
    assert experts["gate_proj"].format == "nvfp4" and experts["gate_proj"].global_multiplies
    e = np.load(HF / "qwen3_moe_nvfp4" / "expected.npz")
    got = np.asarray(model(e["input_ids"]))
    np.testing.assert_allclose(got, e["logits"], rtol=1e-4, atol=1e-4)
    ref = np.asarray(from_pretrained(d, dequantize=True)(e["input_ids"]))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_modelopt_global_scale_in_the_interpreted_kernel():
    import pallas_kernels

    w = quant_weights.quantize(jax.random.normal(jax.random.key(5), (3, 64, 128)), "nvfp4")
    w = type(w)(w.packed, w.scale, 1.0 / w.global_scale, True)  # the same values, ModelOpt's convention
    x = jax.random.normal(jax.random.key(6), (20, 128))
    sizes = jnp.array([7, 0, 13], jnp.int32)
    ref = pallas_kernels.quant_gmm(x, w, sizes, implementation="xla")
    got = pallas_kernels.quant_gmm(x, w, sizes, implementation="interpret")
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen3_moe_nvfp4"])
def test_model_moe_layers_through_interpreted_kernels(case):
    """kernel_backend='interpret': gating, dispatch/combine and the (quantized) grouped matmuls of every MoE layer
    run as Pallas kernels in the CPU interpreter; the logits still match HF's (1e-4) and the XLA model (1e-5)."""
    e = np.load(HF / case / "expected.npz")
    ids = e["input_ids"][:1, :6]
    got = np.asarray(from_pretrained(HF / case, kernel_backend="interpret", **FLOAT_ACTIVATIONS)(ids))
    np.testing.assert_allclose(got, e["logits"][:1, :6], rtol=1e-4, atol=1e-4)
    ref = np.asarray(_load(case)(ids)) if case in QUANT_CASES else np.asarray(from_pretrained(HF / case)(ids))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("element, strategy, fmt", [("int8", "channel", "int8"), ("fp8", "channel", "fp8_channel"),
                                                    ("fp8", "tensor", "fp8_channel")])
def test_compressed_tensors_per_channel_checkpoint(tmp_path, element, strategy, fmt):
    """Kept packed (int8 / e4m3 codes, float32 channel scales), the model equals the float model of the exact
    dequantized values (float32 path, 1e-5) and decodes the same greedy tokens; through the interpreted Pallas
    kernels too."""
    d, twin = tmp_path / "quantized", tmp_path / "twin"
    write_channel_copy(HF / "qwen3_moe", d, twin, element, strategy)
    model = from_pretrained(d, **FLOAT_ACTIVATIONS)
    experts = model.params["layers"][0]["moe"]["experts"]
    assert experts["gate_proj"].format == fmt and experts["gate_proj"].weight.dtype.itemsize == 1
    assert experts["gate_proj"].scale.shape == (*experts["gate_proj"].shape[:-1], 1)
    e = np.load(HF / "qwen3_moe" / "expected.npz")
    ref_model = from_pretrained(twin, **FLOAT_ACTIVATIONS)
    got, ref = np.asarray(model(e["input_ids"])), np.asarray(ref_model(e["input_ids"]))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # the codes' own error against the float model (a routing choice may flip: on average, not everywhere; e4m3
    # keeps 3 mantissa bits, int8 about 7)
    limit = {"int8": 0.05, "fp8": 0.25}[element]
    assert np.abs(got - e["logits"]).mean() < limit * np.abs(e["logits"]).mean()
    from tutel_jax.serving import generate
    np.testing.assert_array_equal(generate(model, e["input_ids"], 6).sequences,
                                  generate(ref_model, e["input_ids"], 6).sequences)
    ids = e["input_ids"][:1, :6]
    interp = np.asarray(from_pretrained(d, kernel_backend="interpret", **FLOAT_ACTIVATIONS)(ids))
    np.testing.assert_allclose(interp, ref[:1, :6], rtol=1e-5, atol=1e-5 * np.abs(ref).max())
