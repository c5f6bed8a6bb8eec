"""`tutel-jax compile`: argument and config checks (any JAX), the abstract weights against the real loader
(any JAX), the analytic roofline against hand counts (any JAX), and deviceless compiles of tiny models for
h100x2 and v5p:2x2x2 (jax >= 0.12 with the CUDA plugin and libtpu; skipped with the reason otherwise)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from tutel_jax.compile import _cli as cli, _driver as driver, _hardware as hardware, _topology as topology
from tutel_jax.compile._roofline import causal_pairs, roofline
from tutel_jax.compile import DevicelessUnavailable, TargetError, parse_target
from tutel_jax.compile._weights import abstract_model
from tutel_jax.models import from_pretrained
from support.channel_checkpoint import write_channel_copy
from support.paths import HF, REPO

MATRIX = REPO / "benchmarks" / "compile_matrix.py"


def _matrix_models() -> dict:
    """The published configs of benchmarks/compile_matrix.py (imported by path, as the script runs)."""
    spec = importlib.util.spec_from_file_location("compile_matrix_script", MATRIX)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MODELS


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _one_error_line(err: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("tutel-jax compile: error:") and "Traceback" not in err
    for w in words:
        assert w in lines[0], (w, lines[0])


# ------------------------------------------------------------------------------- arguments (any JAX)


def test_parse_target_spellings():
    t = parse_target("h100x8")
    assert (t.hardware.name, t.devices, t.topology, t.platform) == ("h100", 8, "1x1x8", "gpu")
    assert parse_target("b200").devices == 1
    t = parse_target("v5p:2x2x2")
    assert (t.devices, t.topology, t.platform) == (8, "2x2x2", "tpu")
    assert parse_target("v6e:2x4").hardware.device_kind == "TPU v6 lite"
    for bad in ("h100x0", "v5e:3x3x3x3", "v5p:2x4", "v5e:0x4", "mi300x", "h100x", "v5e:"):
        with pytest.raises(TargetError, match="--target"):
            parse_target(bad)


def test_hardware_table_has_sources_and_positive_figures():
    for h in hardware.HARDWARE.values():
        assert h.source and h.platform in ("gpu", "tpu")
        assert min(h.hbm_bytes, h.hbm_bytes_per_s, h.peak_bf16_flops, h.interconnect_bytes_per_s) > 0


@pytest.mark.parametrize("target, words", [("mi300x", ["--target", "h100"]), ("v5e:3x3x3x3", ["--target", "2 dimensions"]),
                                           ("h100x0", ["--target", "at least 1"])])
def test_bad_target_exits_2(capsys, target, words):
    rc, out, err = _run(capsys, str(HF / "qwen3_moe"), "--target", target)
    assert rc == 2 and out == ""
    _one_error_line(err, *words)


def test_bad_model_and_arguments_exit_2(capsys, tmp_path):
    rc, _, err = _run(capsys, str(tmp_path / "nope"), "--target", "h100")
    assert rc == 2
    _one_error_line(err, "MODEL", "nope")
    rc, _, err = _run(capsys, str(tmp_path), "--target", "h100")  # a directory without config.json
    assert rc == 2
    _one_error_line(err, "config.json")
    rc, _, err = _run(capsys, str(HF / "qwen3_moe"), "--target", "h100", "--batch", "0")
    assert rc == 2
    _one_error_line(err, "--batch", "positive")
    rc, _, err = _run(capsys, str(HF / "qwen3_moe"))
    assert rc == 2
    _one_error_line(err, "--target")


def test_execution_flags_are_shared_and_checked(capsys):
    """The commands' shared execution flags: compile applies a loaded model's knobs (kernels, dropless, dense and
    attention paths); per_layer_jit and the exchange knobs are refused by name, and so are the CPU kernels."""
    for flag, value in (("--per-layer-jit", "on"), ("--a2a-overlap-degree", "2"), ("--dropless-exchange", "padded")):
        rc, _, err = _run(capsys, str(HF / "qwen3_moe"), "--target", "h100", flag, value)
        assert rc == 2 and f"{flag} does not apply here" in err and len(err.strip().splitlines()) == 1, err
    rc, _, err = _run(capsys, str(HF / "qwen3_moe"), "--target", "h100", "--kernel-backend", "cuda")
    assert rc == 2 and "--kernel-backend" in err and len(err.strip().splitlines()) == 1
    for flag in ("--dropless-impl", "--dense-impl", "--attention-impl"):
        rc, _, err = _run(capsys, str(HF / "qwen3_moe"), "--target", "v5p:2x2x2", flag, "native")
        _one_error_line(err, f"{flag} native: a CPU kernel", "tpu target")
        assert rc == 2


def test_execution_knobs_reach_the_abstract_model():
    """dropless_impl goes to every MoE layer, dense_impl and attention_impl to the model's spec, as
    `from_pretrained`'s arguments of those names do."""
    from tutel_jax.layer import Execution

    config = json.loads((HF / "qwen3_moe" / "config.json").read_text())
    mesh = Mesh(np.array(jax.devices()[:1]), ("expert",))
    model = abstract_model(config, mesh, execution=Execution(dropless_impl="bucketed", dense_impl="xla",
                                                             attention_impl="xla"))
    assert {c.dropless_impl for c in model.moe_configs if c is not None} == {"bucketed"}
    assert (model.spec.dense_impl, model.spec.attention_impl) == ("xla", "xla")
    plain = abstract_model(config, mesh)
    assert plain.spec.dense_impl == "auto" and {c.dropless_impl for c in plain.moe_configs if c is not None} != {
        "bucketed"}


def test_config_missing_a_family_key_exits_2(capsys, tmp_path):
    config = json.loads((HF / "qwen3_moe" / "config.json").read_text())
    del config["num_attention_heads"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    rc, _, err = _run(capsys, str(tmp_path / "config.json"), "--target", "h100")
    assert rc == 2
    _one_error_line(err, "config.json", "num_attention_heads")


def test_old_jax_says_what_to_install(capsys, monkeypatch):
    monkeypatch.setattr(topology, "_jax_version", lambda: (0, 10, 2))
    rc, _, err = _run(capsys, str(HF / "qwen3_moe"), "--target", "h100x2")
    assert rc == 2
    _one_error_line(err, 'pip install "tutel-jax[cuda12]"', "jax >= 0.12")
    with pytest.raises(DevicelessUnavailable, match=r'tutel-jax\[tpu\]'):
        topology.check_deviceless(parse_target("v5p:2x2x2"))


# --------------------------------------------------------------- abstract weights = the loader's (any JAX)


@pytest.mark.parametrize("name", ["qwen3_moe_nvfp4", "gpt_oss_mxfp4", "deepseek_v3_fp8", "qwen2_moe", "mixtral"])
def test_abstract_weights_match_the_loader(name):
    mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
    real = from_pretrained(HF / name, dtype=jnp.bfloat16, mesh=mesh, progress=False, per_layer_jit=False)
    config = json.loads((HF / name / "config.json").read_text())
    model = abstract_model(config, mesh, dtype=jnp.bfloat16)
    got, got_def = jax.tree_util.tree_flatten_with_path(model.params)
    want, want_def = jax.tree_util.tree_flatten_with_path(real.params)
    assert got_def == want_def
    for (path, a), (_, b) in zip(got, want):
        assert (a.shape, a.dtype, a.sharding.spec) == (b.shape, b.dtype, b.sharding.spec), jax.tree_util.keystr(path)
    assert model.moe_configs == real.moe_configs


@pytest.fixture(scope="module")
def qwen3_int8(tmp_path_factory):
    """The float Qwen3-MoE fixture as a compressed-tensors int8 checkpoint."""
    path = tmp_path_factory.mktemp("int8") / "qwen3_moe_int8"
    write_channel_copy(HF / "qwen3_moe", path)
    return path


@pytest.mark.parametrize("element, strategy, dtype", [("int8", "channel", jnp.int8),
                                                     ("fp8", "tensor", jnp.float8_e4m3fn)])
def test_abstract_per_channel_weights_match_the_loader(tmp_path, element, strategy, dtype):
    path = tmp_path / "quantized"
    write_channel_copy(HF / "qwen3_moe", path, element=element, strategy=strategy)
    mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
    real = from_pretrained(path, dtype=jnp.bfloat16, mesh=mesh, progress=False, per_layer_jit=False)
    model = abstract_model(json.loads((path / "config.json").read_text()), mesh, dtype=jnp.bfloat16)
    got, got_def = jax.tree_util.tree_flatten_with_path(model.params)
    want, want_def = jax.tree_util.tree_flatten_with_path(real.params)
    assert got_def == want_def
    assert any(a.dtype == dtype for _, a in got)
    for (path, a), (_, b) in zip(got, want):
        assert (a.shape, a.dtype, a.sharding.spec) == (b.shape, b.dtype, b.sharding.spec), jax.tree_util.keystr(path)


# ------------------------------------------------------------------ the analytic roofline (any JAX)


def _mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("expert",))


def test_hardware_figures_are_the_datasheets_dense_bf16():
    """The figures the floors divide by: NVIDIA's dense BF16 is half the with-sparsity figure its datasheets print
    (H100 / H200 SXM 1,979 -> 989; HGX B200 36 PFLOPS / 8 GPUs with sparsity -> 2.25 PF), HBM and links as the
    vendors state them (GB = 1e9)."""
    h = hardware.HARDWARE
    want = {"a100-40gb": (40, 1555, 312, 600), "a100-80gb": (80, 2039, 312, 600), "h100": (80, 3350, 989, 900),
            "h200": (141, 4800, 989, 900), "b200": (180, 8000, 2250, 1800), "v5e": (16, 819, 197, 400),
            "v5p": (95, 2765, 459, 1200), "v6e": (32, 1638, 918, 800)}
    assert set(want) == set(h)
    for name, (gb, bw, tflops, link) in want.items():
        got = (h[name].hbm_bytes / 1e9, h[name].hbm_bytes_per_s / 1e9, h[name].peak_bf16_flops / 1e12,
               h[name].interconnect_bytes_per_s / 1e9)
        assert got == (gb, bw, tflops, link), name
    # the string an H200 reports (the project's H200 run) differs from the CUDA plugin's target description
    assert (h["h200"].device_kind, h["h200"].gpu_target) == ("NVIDIA H200", "NVIDIA H200 141GB HBM3e")
    assert h["h100"].gpu_target == h["h100"].device_kind == "NVIDIA H100 80GB HBM3"


def test_causal_pairs():
    assert causal_pairs(16, None) == 16 * 17 // 2 == causal_pairs(16, 16) == causal_pairs(16, 100)
    assert causal_pairs(16, 8) == sum(min(i, 8) for i in range(1, 17)) == 100
    assert causal_pairs(1, 8) == 1


def _gpt_oss_hand(config: dict, program: str, B: int, S: int, w: int) -> tuple[float, float]:
    """(flops, bytes) per device of an MXFP4 gpt_oss step, counted from config.json by hand: bf16 attention with
    biases and sinks, float32 router, MXFP4 experts (17 bytes per 32 values) with bf16 biases, experts split
    over w devices, the rest replicated; windows from layer_types."""
    M, H, Hkv, D = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    E, k, I, V = config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"], config["vocab_size"]
    windows = [config["sliding_window"] if t == "sliding_attention" else None for t in config["layer_types"]]
    T = B if program == "decode" else B * S
    dense_params = M * (H + 2 * Hkv) * D + H * D * M + E * M          # qkv, o, router
    dense_bytes = 2 * (M * (H + 2 * Hkv) * D + (H + 2 * Hkv) * D + H * D * M + M + H + 2 * M) + 4 * (E * M + E)
    expert_params = 2 * I * M + M * I
    expert_bytes = expert_params * 17 // 32 + 2 * (2 * I + M)
    touched = math.ceil(min(E, T * k) / w)
    flops = 2 * B * V * M                                              # head: logits of B rows
    nbytes = 2 * (V * M + M) + 2 * M * min(V, T)                       # head + norm, embedding rows
    for window in windows:
        flops += 2 * T * dense_params + 2 * T * k * expert_params / w
        nbytes += dense_bytes + touched * expert_bytes
        if program == "decode":
            keys = min(S, window or S)
            flops += 2 * H * (D + D) * B * keys
            nbytes += 2 * B * Hkv * (D + D) * (keys + 1)               # read the keys' slots, write one
        else:
            flops += 2 * H * (D + D) * B * sum(min(i, window or S) for i in range(1, S + 1))
            nbytes += 2 * B * Hkv * (D + D) * S                        # the prompt's slots written
    return flops, nbytes


@pytest.mark.parametrize("program, B, S", [("decode", 2, 16), ("decode", 1, 5), ("prefill", 2, 16)])
def test_roofline_matches_a_hand_count(program, B, S):
    config = json.loads((HF / "gpt_oss_mxfp4" / "config.json").read_text())
    model = abstract_model(config, _mesh(2), dtype=jnp.bfloat16)
    hw = hardware.HARDWARE["h100"]
    r = roofline(model, program, B, S, hw)
    flops, nbytes = _gpt_oss_hand(config, program, B, S, w=2)
    assert r["source"] == "analytic"
    assert r["flops"] == pytest.approx(flops, rel=1e-12) and r["bytes"] == pytest.approx(nbytes, rel=1e-12)
    assert r["step_seconds_floor"] == pytest.approx(max(flops / hw.peak_bf16_flops, nbytes / hw.hbm_bytes_per_s))
    assert r["tokens"] == (B if program == "decode" else B * S)
    assert r["routed_experts_read_per_layer"] == math.ceil(min(8, r["tokens"] * 2) / 2)


def test_roofline_of_training_is_three_forwards_and_the_optimizer_traffic():
    config = json.loads((HF / "qwen3_moe" / "config.json").read_text())
    model = abstract_model(config, _mesh(2), dtype=jnp.bfloat16, quantized=False)
    hw = hardware.HARDWARE["v5p"]
    B, S = 2, 16
    M, H, Hkv, D = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    E, k, I, V = config["num_local_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"], config["vocab_size"]
    L, T = config["num_hidden_layers"], B * S
    forward = L * (2 * T * (M * (H + 2 * Hkv) * D + H * D * M + E * M) + 2 * T * k * 3 * M * I / 2
                   + 2 * H * 2 * D * B * S * (S + 1) // 2) + 2 * T * V * M   # the head on every position
    # per device, experts split; the router is float32 (fp32_gate): 2 more bytes per value than the helper's
    weights = _qwen3_weight_bytes(config, 2, 2) + L * E * M * 2
    read = weights - 2 * V * M + 2 * M * min(V, T)      # the forward reads the embedding's T rows, not the table
    optimizer = 2 * weights
    r = roofline(model, "train", B, S, hw, optimizer_bytes=optimizer)
    assert r["flops"] == pytest.approx(3 * forward, rel=1e-12)
    assert r["bytes"] == pytest.approx(2 * read + 4 * weights + 2 * optimizer, rel=1e-12)


def test_gpt_oss_20b_decode_at_batch_1_on_h100():
    """About 3.6 GB per token (MXFP4 experts: 4 of 32 per layer; bf16 attention and LM head) -> 1-1.5 ms."""
    model = abstract_model(_matrix_models()["gpt-oss-20b"], _mesh(1), dtype=jnp.bfloat16)
    r = roofline(model, "decode", 1, 4096, hardware.HARDWARE["h100"])
    weights = r["bytes"] - r["bytes_terms"]["kv_cache"]
    assert 3.5e9 < weights < 3.9e9, r["bytes_terms"]
    assert r["bytes_terms"]["kv_cache"] < 0.15e9 and r["routed_experts_read_per_layer"] == 4
    assert r["bound"] == "memory" and 1.0e-3 < r["step_seconds_floor"] < 1.5e-3
    # per device on 8 devices: one routed expert per layer (4 touched over 8), the rest replicated
    r8 = roofline(abstract_model(_matrix_models()["gpt-oss-20b"], _mesh(8), dtype=jnp.bfloat16), "decode", 1, 4096,
                  hardware.HARDWARE["h100"])
    assert r8["routed_experts_read_per_layer"] == 1
    assert r8["bytes_terms"]["routed_experts"] == pytest.approx(r["bytes_terms"]["routed_experts"] / 4)
    assert r8["bytes_terms"]["dense_weights"] == r["bytes_terms"]["dense_weights"]
    assert r8["flops_terms"]["routed_experts"] == pytest.approx(r["flops_terms"]["routed_experts"] / 8)


def test_an_hbm_refusal_is_a_result_other_errors_are_not():
    msg = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required for "
           "HLO temporaries (64.76G) exceeds available HBM (15.75G). HLO module: jit__block.")
    part = driver._oom_part(RuntimeError(msg), {"weights": 10, "activations": 7}, 1.5)
    assert part["transient_bytes"] == int(64.76 * 2**30) + 7 and part["compile_error"].startswith("RESOURCE_EXHAUSTED")
    assert part["kernels"] == {} and part["flops"] == 0.0
    assert driver._oom_part(ValueError("Primitive max requires varying manual axes to match"), {}, 0.1) is None


# ----------------------------------------------------------------------- deviceless compiles (jax >= 0.12)


def _deviceless_missing() -> str | None:
    if tuple(int(p) for p in jax.__version__.split(".")[:2]) < topology.MIN_JAX:
        return f"deviceless compiles need jax >= 0.12, this is jax {jax.__version__}"
    if topology.cuda_plugin_dir() is None:
        return "the CUDA plugin of jax (jax-cuda12-plugin) is not installed"
    if importlib.util.find_spec("libtpu") is None:
        return "libtpu is not installed"
    return None


needs_deviceless = pytest.mark.skipif(_deviceless_missing() is not None, reason=str(_deviceless_missing()))
SCHEMA = {"target", "platform", "device_kind", "devices", "hosts", "hbm_bytes_per_device", "mesh", "programs"}
BYTES = {"weights", "kv_cache", "optimizer", "activations_and_temps", "total"}


def _qwen3_weight_bytes(config: dict, devices: int, itemsize: int) -> int:
    """Per-device weight bytes of a float qwen3_moe, counted from config.json: experts split, the rest whole."""
    M, H, Hkv, D = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    E = config.get("num_experts") or config["num_local_experts"]
    I, V = config["moe_intermediate_size"], config["vocab_size"]
    layer = M * H * D * 2 + M * Hkv * D * 2 + 2 * D + 2 * M + E * M
    experts = E * 3 * M * I // devices
    return itemsize * (config["num_hidden_layers"] * (layer + experts) + 2 * V * M + M)


def _gpt_oss_mxfp4_weight_bytes(config: dict, devices: int) -> int:
    """Per-device weight bytes of an MXFP4 gpt_oss: packed experts (17 bytes per 32 values) split, biases and
    the rest bfloat16."""
    M, H, Hkv, D = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    E, I, V = config["num_local_experts"], config["intermediate_size"], config["vocab_size"]
    attn = 2 * (M * H * D * 2 + M * Hkv * D * 2 + H * D + 2 * Hkv * D + M + H)
    router = 2 * (E * M + E)
    experts = (E * 3 * M * I * 17 // 32 + 2 * E * (2 * I + M)) // devices
    return config["num_hidden_layers"] * (attn + 2 * 2 * M + router + experts) + 2 * (2 * V * M + M)


@pytest.fixture(scope="module")
def qwen3_h100(tmp_path_factory):
    path = tmp_path_factory.mktemp("compile") / "qwen3.json"
    rc = cli.main([str(HF / "qwen3_moe"), "--target", "h100x2", "--batch", "2", "--seq", "16",
                   "--dtype", "bfloat16", "--json", str(path)])
    return rc, json.loads(path.read_text())


@needs_deviceless
def test_qwen3_on_h100x2_report(qwen3_h100):
    rc, report = qwen3_h100
    assert rc == 0
    assert SCHEMA <= set(report)
    assert (report["platform"], report["devices"], report["hosts"]) == ("gpu", 2, 1)
    assert report["device_kind"] == "NVIDIA H100 80GB HBM3" and report["mesh"]["axes"] == {"expert": 2}
    assert [p["program"] for p in report["programs"]] == ["prefill", "decode"]
    config = json.loads((HF / "qwen3_moe" / "config.json").read_text())
    want = _qwen3_weight_bytes(config, 2, 2)
    for p in report["programs"]:
        b = p["bytes_per_device"]
        assert set(b) == BYTES and b["total"] == sum(v for k, v in b.items() if k != "total")
        assert p["fits"] is True and b["optimizer"] == 0 and b["kv_cache"] > 0
        assert abs(b["weights"] - want) <= 0.1 * want, (b["weights"], want)
        assert abs(p["weights_from_programs"] - want) <= 0.1 * want
        assert all(isinstance(k, str) and isinstance(v, int) for k, v in p["kernels"].items())
        assert set(p["collectives"]) == {"all-to-all", "all-reduce", "all-gather", "reduce-scatter",
                                         "collective-permute"}
        assert p["collectives"]["all-reduce"] >= config["num_hidden_layers"]  # expert-sliced: one psum per layer
        r, x = p["roofline"], p["xla_cost"]
        assert r["source"] == "analytic" and r["bound"] in ("memory", "compute") and r["flops"] > 0 and r["bytes"] > 0
        assert r["step_seconds_floor"] == pytest.approx(max(r["flops"] / hardware.HARDWARE["h100"].peak_bf16_flops,
                                                            r["bytes"] / hardware.HARDWARE["h100"].hbm_bytes_per_s))
        # the GPU compiler reports no cost: XLA's numbers come from the host's HLO cost analysis, labelled
        assert x["source"] == "hlo-cost-analysis" and "0 flops" in x["note"] and x["flops"] >= 0
        assert p["compile_errors"] == []
        assert p["compile_seconds"] > 0


@needs_deviceless
def test_gpt_oss_on_v5p_that_does_not_fit(capsys, monkeypatch, tmp_path):
    """The same tiny model against a v5p whose HBM is set to 1 MiB: table and JSON still written, exit 2 with
    the bytes needed, the HBM and a device count."""
    small = dataclasses.replace(hardware.HARDWARE["v5p"], hbm_bytes=2**20)
    monkeypatch.setitem(hardware.HARDWARE, "v5p", small)
    monkeypatch.setitem(topology.HARDWARE, "v5p", small)
    path = tmp_path / "gpt_oss.json"
    rc, out, err = _run(capsys, str(HF / "gpt_oss_mxfp4"), "--target", "v5p:2x2x2", "--batch", "2",
                        "--seq", "16", "--json", str(path))
    assert rc == 2 and "prefill" in out and "decode" in out
    _one_error_line(err, "GiB per device", "v5p:2x2x2", "HBM")
    report = json.loads(path.read_text())
    assert (report["platform"], report["devices"], report["hosts"]) == ("tpu", 8, 2)
    assert report["device_kind"] == "TPU v5" and report["hbm_bytes_per_device"] == 2**20
    config = json.loads((HF / "gpt_oss_mxfp4" / "config.json").read_text())
    want = _gpt_oss_mxfp4_weight_bytes(config, 8)
    for p in report["programs"]:
        assert p["fits"] is False
        assert abs(p["bytes_per_device"]["weights"] - want) <= 0.1 * want, (p["bytes_per_device"]["weights"], want)
        assert set(p["collectives"]) >= {"all-reduce"} and p["collectives"]["all-reduce"] > 0
        assert isinstance(p["kernels"], dict)


def _qwen3_int8_weight_bytes(config: dict, devices: int) -> int:
    """Per-device weight bytes of an int8 qwen3_moe (compressed-tensors): every *_proj an int8 byte per value
    and a float32 scale per output row, experts split; norms, router, embeddings and lm_head float32."""
    M, H, Hkv, D = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    E = config.get("num_experts") or config["num_local_experts"]
    I, V = config["moe_intermediate_size"], config["vocab_size"]
    attn = 2 * M * H * D + 2 * M * Hkv * D + 4 * (H * D + 2 * Hkv * D + M)
    layer = attn + 4 * (2 * D + 2 * M + E * M)
    experts = (E * 3 * M * I + 4 * E * (2 * I + M)) // devices
    return config["num_hidden_layers"] * (layer + experts) + 4 * (2 * V * M + M)


@needs_deviceless
def test_int8_checkpoint_on_v5p_holds_the_int8_kernel(capsys, qwen3_int8, tmp_path):
    """A compressed-tensors int8 config compiled for a v5p topology: its experts' grouped matmuls are the Mosaic
    int8 kernel, and the weights per device are the int8 bytes (+ scales) of a hand count."""
    path = tmp_path / "int8.json"
    rc, out, err = _run(capsys, str(qwen3_int8 / "config.json"), "--target", "v5p:2x2x2", "--batch", "2",
                        "--seq", "16", "--json", str(path))
    assert rc == 0, err
    report = json.loads(path.read_text())
    config = json.loads((qwen3_int8 / "config.json").read_text())
    want = _qwen3_int8_weight_bytes(config, 8)
    for p in report["programs"]:
        assert any("tutel_tpu_quant_gmm_int8" in name for name in p["kernels"]), p["kernels"]
        assert abs(p["bytes_per_device"]["weights"] - want) <= 0.1 * want, (p["bytes_per_device"]["weights"], want)
