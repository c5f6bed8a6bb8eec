"""Export back to HF safetensors (`tutel_jax.models.save_pretrained`) and bad checkpoints at load time.

Export: every float fixture round-trips to the same tensor names and bit-identical values, and the re-loaded
model gives bit-identical logits. Bad input: a clear ValueError naming the file or tensor, nothing returned."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from tutel_jax.checkpoint import open_checkpoint
from tutel_jax.models import from_pretrained, save_pretrained
from support.paths import HF

FLOAT_CASES = ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "glm4_moe", "gpt_oss", "olmoe"]


@pytest.mark.parametrize("case", FLOAT_CASES)
def test_export_round_trip_is_exact(case, tmp_path):
    model = from_pretrained(HF / case)
    save_pretrained(model, tmp_path / "out")
    original, exported = open_checkpoint(HF / case), open_checkpoint(tmp_path / "out")
    try:
        assert sorted(exported) == sorted(original)
        for name in original:
            a, b = original[name], exported[name]
            assert a.dtype == b.dtype and a.shape == b.shape, name
            np.testing.assert_array_equal(a, b, err_msg=name)
    finally:
        original.close()
        exported.close()
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads((HF / case / "config.json")
                                                                                     .read_text())
    ids = np.load(HF / case / "expected.npz")["input_ids"]
    np.testing.assert_array_equal(np.asarray(from_pretrained(tmp_path / "out")(ids)), np.asarray(model(ids)))
    assert not [p for p in os.listdir(tmp_path / "out") if p.endswith(".tmp")]


def test_kimi_k2_is_deepseek_v3_under_another_name(tmp_path):
    d = _copy("deepseek_v3", tmp_path / "kimi")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(config, model_type="kimi_k2")))
    ids = np.load(HF / "deepseek_v3" / "expected.npz")["input_ids"]
    model = from_pretrained(d)
    assert model.spec.model_type == "deepseek_v3"
    np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(from_pretrained(HF / "deepseek_v3")(ids)))
    save_pretrained(model, tmp_path / "out")  # keeps its own model_type
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "kimi_k2"


def test_export_refuses_quantized_models_and_writes_nothing(tmp_path):
    model = from_pretrained(HF / "qwen3_moe_nvfp4")
    with pytest.raises(ValueError, match="float checkpoints only.*dequantize=True"):
        save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    save_pretrained(from_pretrained(HF / "qwen3_moe_nvfp4", dequantize=True), tmp_path / "out")
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())


def test_interrupted_export_keeps_the_previous_file(tmp_path, monkeypatch):
    import safetensors.numpy

    model = from_pretrained(HF / "mixtral")
    save_pretrained(model, tmp_path)
    before = (tmp_path / "model.safetensors").read_bytes()

    def crash(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.numpy, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(model, tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]


def _copy(case: str, dst: Path) -> Path:
    shutil.copytree(HF / case, dst)
    return dst


def test_corrupt_header_names_the_file(tmp_path):
    d = _copy("mixtral", tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:8] + b"{not json" + data[17:])
    with pytest.raises(ValueError, match="model.safetensors"):
        from_pretrained(d)
    (d / "model.safetensors").write_bytes(data[:100])  # truncated
    with pytest.raises(ValueError, match="model.safetensors"):
        from_pretrained(d)


def test_missing_shard_names_the_shard(tmp_path):
    d = _copy("mixtral", tmp_path / "m")
    with open_checkpoint(d) as ckpt:
        names = list(ckpt)
    index = {"weight_map": {n: ("model-00001-of-00002.safetensors" if i % 2 else
                                "model-00002-of-00002.safetensors") for i, n in enumerate(names)}}
    os.rename(d / "model.safetensors", d / "model-00001-of-00002.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors.*missing"):
        from_pretrained(d)


def test_shape_mismatch_names_the_tensor(tmp_path):
    ckpt = open_checkpoint(HF / "qwen3_moe")
    tensors = dict(ckpt)
    ckpt.close()
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name][:, :-1]
    with pytest.raises(ValueError, match=f"{name}.*shape"):
        from_pretrained(HF / "qwen3_moe", tensors=tensors)
    tensors = dict(open_checkpoint(HF / "qwen3_moe"))
    expert = "model.layers.1.mlp.experts.3.down_proj.weight"
    tensors[expert] = tensors[expert][:-1]
    with pytest.raises(ValueError, match="shape"):
        from_pretrained(HF / "qwen3_moe", tensors=tensors)


def test_bad_config_and_unknown_quantization(tmp_path):
    d = _copy("qwen3_moe_nvfp4", tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(config, quantization_config={"quant_method": "awq"})))
    with pytest.raises(ValueError, match="unsupported quantization method 'awq'"):
        from_pretrained(d)
    (d / "config.json").write_text("{broken")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        from_pretrained(d)
    (d / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "num_hidden_layers"}))
    with pytest.raises(ValueError, match="num_hidden_layers: missing"):
        from_pretrained(d)
