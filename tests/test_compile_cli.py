"""`tutel-jax compile`: argument and config checks (any JAX), the abstract weights against the real loader
(any JAX), and deviceless compiles of tiny models for h100x2 and v5p:2x2x2 (jax >= 0.12 with the CUDA plugin
and libtpu; skipped with the reason otherwise)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from tutel_jax.compile import cli, hardware, topology
from tutel_jax.compile.topology import DevicelessUnavailable, TargetError, parse_target
from tutel_jax.compile.weights import abstract_model
from tutel_jax.models.causal_lm import from_pretrained

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


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
    rc, out, err = _run(capsys, str(FIXTURES / "qwen3_moe"), "--target", target)
    assert rc == 2 and out == ""
    _one_error_line(err, *words)


def test_bad_model_and_arguments_exit_2(capsys, tmp_path):
    rc, _, err = _run(capsys, str(tmp_path / "nope"), "--target", "h100")
    assert rc == 2
    _one_error_line(err, "MODEL", "nope")
    rc, _, err = _run(capsys, str(tmp_path), "--target", "h100")  # a directory without config.json
    assert rc == 2
    _one_error_line(err, "config.json")
    rc, _, err = _run(capsys, str(FIXTURES / "qwen3_moe"), "--target", "h100", "--batch", "0")
    assert rc == 2
    _one_error_line(err, "--batch", "positive")
    rc, _, err = _run(capsys, str(FIXTURES / "qwen3_moe"))
    assert rc == 2
    _one_error_line(err, "--target")


def test_config_missing_a_family_key_exits_2(capsys, tmp_path):
    config = json.loads((FIXTURES / "qwen3_moe" / "config.json").read_text())
    del config["num_attention_heads"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    rc, _, err = _run(capsys, str(tmp_path / "config.json"), "--target", "h100")
    assert rc == 2
    _one_error_line(err, "config.json", "num_attention_heads")


def test_old_jax_says_what_to_install(capsys, monkeypatch):
    monkeypatch.setattr(topology, "_jax_version", lambda: (0, 10, 2))
    rc, _, err = _run(capsys, str(FIXTURES / "qwen3_moe"), "--target", "h100x2")
    assert rc == 2
    _one_error_line(err, 'pip install "tutel-jax[cuda12]"', "jax >= 0.12")
    with pytest.raises(DevicelessUnavailable, match=r'tutel-jax\[tpu\]'):
        topology.check_deviceless(parse_target("v5p:2x2x2"))


# --------------------------------------------------------------- abstract weights = the loader's (any JAX)


@pytest.mark.parametrize("name", ["qwen3_moe_nvfp4", "gpt_oss_mxfp4", "deepseek_v3_fp8", "qwen2_moe", "mixtral"])
def test_abstract_weights_match_the_loader(name):
    mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
    real = from_pretrained(FIXTURES / name, dtype=jnp.bfloat16, mesh=mesh, progress=False, per_layer_jit=False)
    config = json.loads((FIXTURES / name / "config.json").read_text())
    model = abstract_model(config, mesh, dtype=jnp.bfloat16)
    got, got_def = jax.tree_util.tree_flatten_with_path(model.params)
    want, want_def = jax.tree_util.tree_flatten_with_path(real.params)
    assert got_def == want_def
    for (path, a), (_, b) in zip(got, want):
        assert (a.shape, a.dtype, a.sharding.spec) == (b.shape, b.dtype, b.sharding.spec), jax.tree_util.keystr(path)
    assert model.moe_configs == real.moe_configs


# ----------------------------------------------------------------------- deviceless compiles (jax >= 0.12)


def _deviceless_missing() -> str | None:
    if tuple(int(p) for p in jax.__version__.split(".")[:2]) < topology.MIN_JAX:
        return f"deviceless compiles need jax >= 0.12, this is jax {jax.__version__}"
    if topology._cuda_plugin_dir() is None:
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
    rc = cli.main([str(FIXTURES / "qwen3_moe"), "--target", "h100x2", "--batch", "2", "--seq", "16",
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
    config = json.loads((FIXTURES / "qwen3_moe" / "config.json").read_text())
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
        r = p["roofline"]
        assert r["bound"] in ("memory", "compute") and r["flops"] > 0 and r["bytes"] > 0
        assert r["step_seconds_floor"] == pytest.approx(max(r["flops"] / hardware.HARDWARE["h100"].peak_bf16_flops,
                                                            r["bytes"] / hardware.HARDWARE["h100"].hbm_bytes_per_s))
        assert p["compile_seconds"] > 0


@needs_deviceless
def test_gpt_oss_on_v5p_that_does_not_fit(capsys, monkeypatch, tmp_path):
    """The same tiny model against a v5p whose HBM is set to 1 MiB: table and JSON still written, exit 2 with
    the bytes needed, the HBM and a device count."""
    small = dataclasses.replace(hardware.HARDWARE["v5p"], hbm_bytes=2**20)
    monkeypatch.setitem(hardware.HARDWARE, "v5p", small)
    monkeypatch.setitem(topology.HARDWARE, "v5p", small)
    path = tmp_path / "gpt_oss.json"
    rc, out, err = _run(capsys, str(FIXTURES / "gpt_oss_mxfp4"), "--target", "v5p:2x2x2", "--batch", "2",
                        "--seq", "16", "--json", str(path))
    assert rc == 2 and "prefill" in out and "decode" in out
    _one_error_line(err, "GiB per device", "v5p:2x2x2", "HBM")
    report = json.loads(path.read_text())
    assert (report["platform"], report["devices"], report["hosts"]) == ("tpu", 8, 2)
    assert report["device_kind"] == "TPU v5" and report["hbm_bytes_per_device"] == 2**20
    config = json.loads((FIXTURES / "gpt_oss_mxfp4" / "config.json").read_text())
    want = _gpt_oss_mxfp4_weight_bytes(config, 8)
    for p in report["programs"]:
        assert p["fits"] is False
        assert abs(p["bytes_per_device"]["weights"] - want) <= 0.1 * want, (p["bytes_per_device"]["weights"], want)
        assert set(p["collectives"]) >= {"all-reduce"} and p["collectives"]["all-reduce"] > 0
        assert isinstance(p["kernels"], dict)
