"""Checkpoint layouts (`random_init.hf_tensor_shapes`, `quant_layout.checkpoint_layout`) against the real HF
fixtures, the streaming sharded writer, the real-shape generator (`benchmarks/make_real_size.py`, its tiny
variants) and header checks that refuse bad files before anything large is read."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import tracemalloc
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from tutel_jax.checkpoint._safetensors_io import DTYPES, SafetensorsFile, open_checkpoint
from tutel_jax.checkpoint import TensorInfo, plan_shards, shard_is_complete, write_index, write_shard
from tutel_jax.models import (from_pretrained, checkpoint_layout, hf_tensor_shapes, random_hf_tensors, load_params,
                              spec_from_config)
from support.paths import HF, REPO

FLOAT_CASES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3", "gpt_oss", "glm4_moe")
QUANT_CASES = ("gpt_oss_mxfp4", "qwen3_moe_nvfp4", "deepseek_v3_fp8")


def _config(case: str) -> dict:
    return json.loads((HF / case / "config.json").read_text())


def _on_disk(case: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    with open_checkpoint(HF / case) as ckpt:
        return {name: ckpt.info(name)[:2] for name in ckpt}


@pytest.mark.parametrize("case", FLOAT_CASES)
def test_float_layout_is_the_fixtures(case):
    config = _config(case)
    shapes = hf_tensor_shapes(config)
    assert {k: v[1] for k, v in _on_disk(case).items()} == shapes
    tensors = random_hf_tensors(config, seed=1)
    params, _ = load_params(tensors, config, spec_from_config(config))  # every name and shape is accepted
    assert len(params["layers"]) == config["num_hidden_layers"]


@pytest.mark.parametrize("case", QUANT_CASES + FLOAT_CASES)
def test_checkpoint_layout_is_the_fixtures(case):
    layout = checkpoint_layout(_config(case))
    assert {t.name: (t.dtype, t.shape) for t, _ in layout} == _on_disk(case)


def test_layout_errors():
    config = _config("qwen3_moe_nvfp4")
    with pytest.raises(ValueError, match="unsupported quant_method 'gptq'"):
        checkpoint_layout(dict(config, quantization_config={"quant_method": "gptq"}))
    with pytest.raises(ValueError, match="multiple of the NVFP4 block 16"):
        checkpoint_layout(dict(config, moe_intermediate_size=40))
    with pytest.raises(ValueError, match="config dtype 'int8'"):
        checkpoint_layout(dict(config, dtype="int8"))


# ------------------------------------------------------------------------------------------------ the writer

def _fill_arange(info, f):
    n = info.nbytes // DTYPES[info.dtype].itemsize
    f.write((np.arange(n) % 251).astype(DTYPES[info.dtype]).tobytes())


def test_plan_write_read_resume(tmp_path):
    infos = [TensorInfo("a", "F32", (10, 3)), TensorInfo("b", "BF16", (7,)), TensorInfo("c", "U8", (100,)),
             TensorInfo("d", "F8_E4M3", (4, 4)), TensorInfo("e", "F32", (0,))]
    shards = plan_shards(infos, max_shard_bytes=120)
    assert [s.filename for s in shards] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [[t.name for t in s.tensors] for s in shards] == [["a"], ["b", "c"], ["d", "e"]]
    for s in shards:
        assert not shard_is_complete(tmp_path / s.filename, s)
        write_shard(tmp_path / s.filename, s, _fill_arange)
        assert shard_is_complete(tmp_path / s.filename, s)
        assert len(s.header()) % 8 == 0
    write_index(tmp_path, shards)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 120 + 14 + 100 + 16
    with open_checkpoint(tmp_path) as ckpt:
        for t in infos:
            n = t.nbytes // DTYPES[t.dtype].itemsize
            np.testing.assert_array_equal(ckpt[t.name].reshape(-1).astype(np.float32),
                                          (np.arange(n) % 251).astype(DTYPES[t.dtype]).astype(np.float32))
    # a shard cut short is not complete; a single shard is model.safetensors with no index
    path = tmp_path / shards[1].filename
    path.write_bytes(path.read_bytes()[:-1])
    assert not shard_is_complete(path, shards[1])
    single = plan_shards(infos)
    assert [s.filename for s in single] == ["model.safetensors"] and write_index(tmp_path / "x", single) is None


def test_writer_errors(tmp_path):
    with pytest.raises(ValueError, match="tensor 'a' appears twice"):
        plan_shards([TensorInfo("a", "F32", (1,)), TensorInfo("a", "F32", (1,))])
    with pytest.raises(ValueError, match="unknown dtype 'F4'"):
        plan_shards([TensorInfo("a", "F4", (1,))])
    shard = plan_shards([TensorInfo("a", "F32", (4,))])[0]
    with pytest.raises(RuntimeError, match="tensor 'a': wrote 4 bytes, expected 16"):
        write_shard(tmp_path / shard.filename, shard, lambda info, f: f.write(b"1234"))
    assert list(tmp_path.iterdir()) == []  # neither the shard nor its .partial is left


# ------------------------------------------------------------------------------------- the real-shape generator

def _make_real_size():
    spec = importlib.util.spec_from_file_location("make_real_size_bench", REPO / "benchmarks" / "make_real_size.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MRS = _make_real_size()


def test_real_configs_and_sizes():
    # the released models' shapes: GPT-OSS-20B about 13.8 GB packed, every shard at most 5 GB
    for name, low, high in (("gpt-oss-20b", 13.5e9, 14.0e9), ("qwen3-30b-a3b-half", 9.0e9, 10.5e9),
                            ("deepseek-v3-layer", 15.0e9, 16.5e9)):
        layout = checkpoint_layout(MRS.MODELS[name])
        shards = plan_shards([t for t, _ in layout])
        assert low < MRS.model_bytes(name) < high and len(shards) > 1
        assert all(s.data_bytes <= 5 * 10**9 for s in shards)
    gpt = {t.name: t for t, _ in checkpoint_layout(MRS.MODELS["gpt-oss-20b"])}
    assert gpt["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape == (32, 5760, 90, 16)
    assert gpt["model.embed_tokens.weight"].shape == (201088, 2880)
    spec = spec_from_config(MRS.MODELS["gpt-oss-20b"])
    assert spec.num_layers == 24 and spec.num_heads == 64 and spec.num_kv_heads == 8 and spec.head_dim == 64


def test_every_role_of_every_format_can_be_generated():
    """The generator draws values for each role a checkpoint layout can hold (float roles in each float dtype, every
    weight format's parts in the dtype its layout writes: the role's first), finite and of the requested count."""
    from tutel_jax.models._quant_layout import ALLOWED_DTYPES

    rng = np.random.default_rng(0)
    for role, codes in ALLOWED_DTYPES.items():
        for code in codes if role in ("normal", "ones", "zeros") else codes[:1]:
            values = MRS._draw(role, TensorInfo("x", code, (64,)), 64, rng, 0.02)
            assert values.dtype == DTYPES[code] and values.shape == (64,), (role, code)
            assert np.isfinite(values.astype(np.float32)).all(), (role, code)


@pytest.mark.parametrize("name", ["gpt-oss-20b-tiny", "qwen3-30b-a3b-half-tiny", "deepseek-v3-layer-tiny"])
def test_tiny_models_generate_load_and_resume(tmp_path, name):
    out = MRS.make_model(name, tmp_path, progress=False, max_shard_bytes=600_000)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 2 and (out / "model.safetensors.index.json").is_file()
    with open_checkpoint(out) as ckpt:
        for t, role in checkpoint_layout(MRS.MODELS[name]):
            a = ckpt[t.name]
            assert a.shape == t.shape and a.dtype == DTYPES[t.dtype]
            if role == "e8m0":
                assert 118 <= a.min() and a.max() <= 121
            if role in ("fp8", "e4m3_scale"):
                v = a.astype(np.float32)
                assert np.isfinite(v).all() and np.abs(v).max() < 2
                if role == "e4m3_scale":
                    assert v.min() >= 1.0
    model = from_pretrained(out, dtype=jnp.float32)
    logits = np.asarray(model(np.arange(10).reshape(2, 5)))
    assert logits.shape == (2, 5, MRS.MODELS[name]["vocab_size"]) and np.isfinite(logits).all()
    assert 1e-3 < np.abs(logits).mean() < 50
    # resume: complete shards are kept, a damaged one is rewritten identically
    stamps = {p: p.stat().st_mtime_ns for p in shards}
    good = shards[0].read_bytes()
    shards[0].write_bytes(good[:-10])
    MRS.make_model(name, tmp_path, progress=False, max_shard_bytes=600_000)
    assert shards[0].read_bytes() == good
    assert all(p.stat().st_mtime_ns == stamps[p] for p in shards[1:])


# --------------------------------------------------------------------------------- bad input, before allocation

def _tiny_copy(tmp_path, name="gpt-oss-20b-tiny"):
    return MRS.make_model(name, tmp_path, progress=False, max_shard_bytes=600_000)


def test_wrong_dtype_and_shape_named_before_reading(tmp_path):
    out = _tiny_copy(tmp_path)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.experts.down_proj_scales"
    shard = out / index["weight_map"][name]
    raw = bytearray(shard.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    for field, value, match in (("dtype", "I8", rf"{shard.name}: tensor '{name}' is I8, but a gpt_oss mxfp4 "
                                                 "checkpoint stores it as U8"),
                                ("shape", [8, 64, 8], rf"{shard.name}: tensor '{name}' has shape \[8, 64, 8\]; "
                                                      r"the config implies \[8, 128, 4\]")):
        bad = dict(header, **{name: dict(header[name], **{field: value})})  # shape: the same byte count
        text = json.dumps(bad).encode()
        text += b" " * (-(len(text)) % 8)
        fixed = struct.pack("<Q", len(text)) + text + bytes(raw[8 + n:])
        shard.write_bytes(fixed)
        with pytest.raises(ValueError, match=match):
            from_pretrained(out)


def test_truncated_5gb_shard_and_bad_index_fail_before_allocating(tmp_path):
    out = _tiny_copy(tmp_path)
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    # a 5 GB shard cut short (a sparse file: nothing is written to disk)
    big = {"model.embed_tokens.weight": {"dtype": "BF16", "shape": [50_000, 50_000],
                                         "data_offsets": [0, 5 * 10**9]}}
    text = json.dumps(big).encode()
    text += b" " * (-len(text) % 8)
    shard = out / index["weight_map"]["model.embed_tokens.weight"]
    saved = shard.read_bytes()
    with open(shard, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + 5 * 10**9 - 4096)
    tracemalloc.start()
    with pytest.raises(ValueError, match=rf"{shard.name}: tensor 'model.embed_tokens.weight': truncated file"):
        from_pretrained(out)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 20 * 2**20
    shard.write_bytes(saved)
    # a shard missing, and an index that maps a tensor to a shard that does not hold it
    moved = dict(index, weight_map=dict(index["weight_map"], **{"model.norm.weight": "model-00009-of-00009.safetensors"}))
    index_path.write_text(json.dumps(moved))
    with pytest.raises(ValueError, match="shard 'model-00009-of-00009.safetensors' is missing"):
        from_pretrained(out)
    other = next(s for s in sorted(set(index["weight_map"].values())) if s != index["weight_map"]["model.norm.weight"])
    index_path.write_text(json.dumps(dict(index, weight_map=dict(index["weight_map"], **{"model.norm.weight": other}))))
    with pytest.raises(ValueError, match=rf"tensor 'model.norm.weight' is mapped to '{other}', which does not hold it"):
        from_pretrained(out)


def test_reading_maps_nothing_and_refuses_a_file_truncated_since_opened(tmp_path):
    # tensors are read straight into their arrays: no mapping of the file (resident memory is the copy alone)
    path = tmp_path / "x.safetensors"
    shard = plan_shards([TensorInfo("w", "U8", (64 * 2**20,)), TensorInfo("v", "U8", (2**20,))])[0]
    write_shard(path, shard, lambda info, f: f.write(np.ones(info.nbytes, np.uint8).tobytes()))
    f = SafetensorsFile(path)
    a = f.get("w")
    assert a.sum() == 64 * 2**20
    assert str(path) not in Path("/proc/self/smaps").read_text()
    # the file shrinks under the open reader: a clear error naming the tensor, not a crash (SIGBUS)
    os.truncate(path, path.stat().st_size - 2**20 // 2)
    last = max(("w", "v"), key=lambda n: f._entries[n][2])
    with pytest.raises(ValueError, match=rf"tensor '{last}': the file ends at byte \d+, inside the tensor "
                                         r"\(truncated since"):
        f.get(last)
    f.close()
