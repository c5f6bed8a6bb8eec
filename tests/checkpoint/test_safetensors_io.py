"""tutel_jax.checkpoint._safetensors_io: round trip against the `safetensors` writer, every dtype, crafted bad files."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from tutel_jax.checkpoint._safetensors_io import SafetensorsFile, open_checkpoint
from support.paths import HF



def _write_raw(path: Path, header: dict, data: bytes, header_len: int | None = None) -> Path:
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h) if header_len is None else header_len) + h + data)
    return path


def test_round_trip_with_safetensors_writer(tmp_path):
    from safetensors.numpy import save_file
    rng = np.random.default_rng(0)
    tensors = {"f32": rng.normal(size=(3, 5)).astype(np.float32),
               "f16": rng.normal(size=(4,)).astype(np.float16),
               "f64": rng.normal(size=(2, 2)), "i64": np.arange(6, dtype=np.int64).reshape(2, 3),
               "i32": np.array([-1, 7], np.int32), "u8": np.arange(10, dtype=np.uint8), "i8": np.array([-3], np.int8),
               "i16": np.array([300, -2], np.int16), "b": np.array([True, False]), "empty": np.zeros((0, 3), np.float32),
               "scalar": np.array(2.5, np.float32)}
    save_file(tensors, str(tmp_path / "a.safetensors"), metadata={"format": "np"})
    with SafetensorsFile(tmp_path / "a.safetensors") as f:
        assert set(f.keys()) == set(tensors) and f.metadata == {"format": "np"}
        for name, want in tensors.items():
            got = f.get(name)
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)
        assert f.get("missing") is None
        with pytest.raises(KeyError, match="a.safetensors"):
            f["missing"]
        assert f.shape("f32") == (3, 5) and f.dtype("f16") == np.float16
        got = f.get("f32")
        got[0, 0] = 99.0  # a copy: the file is read-only and unaffected
        assert f.get("f32")[0, 0] != 99.0


@pytest.mark.parametrize("code,dtype", [("BF16", ml_dtypes.bfloat16), ("F8_E4M3", ml_dtypes.float8_e4m3fn),
                                        ("F8_E5M2", ml_dtypes.float8_e5m2)])
def test_ml_dtypes(tmp_path, code, dtype):
    values = np.array([[0.5, -1.5, 2.0], [448.0 if code == "F8_E4M3" else 3.0, 0.0, -0.25]], np.float32).astype(dtype)
    data = values.tobytes()
    p = _write_raw(tmp_path / "x.safetensors", {"w": {"dtype": code, "shape": [2, 3], "data_offsets": [0, len(data)]}},
                   data)
    got = SafetensorsFile(p).get("w")
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got.astype(np.float32), values.astype(np.float32))


def test_reads_hf_fixture():
    ckpt = open_checkpoint(HF / "qwen3_moe")
    w = ckpt["lm_head.weight"]
    assert w.shape == (128, 64) and w.dtype == np.float32 and "model.embed_tokens.weight" in ckpt


def _entry(begin, end, dtype="F32", shape=(2,)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


@pytest.mark.parametrize("header,data,header_len,match", [
    ({"a": _entry(0, 8)}, b"\0" * 4, None, "truncated"),                       # data cut short
    ({"a": _entry(0, 8)}, b"\0" * 8, 10 ** 6, "truncated"),                     # header length past the end
    ({"a": _entry(0, 8)}, b"\0" * 8, 2 ** 40, "limit"),                         # absurd header length
    ({"a": _entry(0, 12)}, b"\0" * 12, None, "needs 8"),                        # byte count != shape
    ({"a": _entry(0, 8), "b": _entry(4, 12)}, b"\0" * 12, None, "overlap"),
    ({"a": _entry(8, 0)}, b"\0" * 8, None, "bad data_offsets"),
    ({"a": _entry(0, 8, dtype="F7")}, b"\0" * 8, None, "unsupported dtype"),
    ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "shape"),
    ({"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, None, "data_offsets"),
    ({"__metadata__": {"x": 1}}, b"", None, "__metadata__"),
])
def test_corrupt_files_raise_clear_errors(tmp_path, header, data, header_len, match):
    p = _write_raw(tmp_path / "bad.safetensors", header, data, header_len)
    with pytest.raises(ValueError, match=match) as e:
        SafetensorsFile(p)
    assert "bad.safetensors" in str(e.value)
    if "a" in header and match not in ("limit", "__metadata__"):
        assert "'a'" in str(e.value) or "truncated" in str(e.value)


def test_bad_json_and_tiny_file(tmp_path):
    p = tmp_path / "j.safetensors"
    p.write_bytes(struct.pack("<Q", 3) + b"{x}")
    with pytest.raises(ValueError, match="JSON"):
        SafetensorsFile(p)
    (tmp_path / "t.safetensors").write_bytes(b"\1\2")
    with pytest.raises(ValueError, match="truncated"):
        SafetensorsFile(tmp_path / "t.safetensors")


def test_sharded_checkpoint_and_missing_shard(tmp_path):
    from safetensors.numpy import save_file
    save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": np.zeros(3, np.int32)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    ckpt = open_checkpoint(tmp_path)
    assert sorted(ckpt) == ["a", "b"]
    np.testing.assert_array_equal(ckpt["b"], np.zeros(3, np.int32))
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors"):
        open_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="no model.safetensors"):
        open_checkpoint(tmp_path / "nowhere")
