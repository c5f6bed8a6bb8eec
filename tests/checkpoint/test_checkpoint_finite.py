"""Non-finite weights are refused at load (`from_pretrained(check_finite=True)`, the default): HF fixtures with
corrupted bytes in one tensor (a float NaN / inf, an MXFP4 E8M0 scale 0xFF, a NaN FP8 weight_scale_inv, an NVFP4
e4m3 scale NaN code, an FP8 e4m3 weight NaN code) fail with `NonFiniteTensorError` naming the file and the
tensor; `check_finite=False` loads them; `tutel-jax generate` prints one line and exits 2."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from tutel_jax.checkpoint import CheckpointFormatError, NonFiniteTensorError
from tutel_jax.checkpoint._safetensors_io import SafetensorsFile, count_nonfinite
from tutel_jax.models import from_pretrained
from support.paths import HF


F32_NAN, F32_INF = b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f"  # little-endian float32 bits
BF16_INF = b"\x80\x7f"

# (fixture, tensor, [(element index, bytes to write there)], non-finite count)
CORRUPTIONS = {
    "f32-weight": ("qwen3_moe", "model.layers.1.mlp.experts.2.up_proj.weight", [(3, F32_NAN), (17, F32_INF)], 2),
    "f32-embed": ("qwen3_moe", "model.embed_tokens.weight", [(0, b"\x00\x00\x80\xff")], 1),  # -inf
    "bf16-attn": ("gpt_oss_mxfp4", "model.layers.0.self_attn.q_proj.weight", [(5, BF16_INF)], 1),
    "mxfp4-e8m0-scale": ("gpt_oss_mxfp4", "model.layers.0.mlp.experts.down_proj_scales", [(1, b"\xff")], 1),
    "fp8-scale-inv": ("deepseek_v3_fp8", "model.layers.1.mlp.experts.0.up_proj.weight_scale_inv",
                      [(0, F32_NAN)], 1),
    "fp8-e4m3-weight": ("deepseek_v3_fp8", "model.layers.0.mlp.gate_proj.weight", [(9, b"\x7f"), (10, b"\xff")], 2),
    "nvfp4-e4m3-scale": ("qwen3_moe_nvfp4", "model.layers.0.mlp.experts.3.gate_proj.weight_scale",
                         [(2, b"\x7f"), (6, b"\xff")], 2),
    "nvfp4-global-scale": ("qwen3_moe_nvfp4", "model.layers.1.mlp.experts.0.down_proj.weight_global_scale",
                           [(0, F32_INF)], 1),
}


def _header(path: Path) -> tuple[int, dict]:
    """(start of the data section, header) of a safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return 8 + n, json.loads(raw[8:8 + n])


def _corrupt(path: Path, tensor: str, pokes: list[tuple[int, bytes]]) -> None:
    """Overwrite elements of `tensor` in the safetensors file `path` with the given raw bytes."""
    start, header = _header(path)
    begin, end = header[tensor]["data_offsets"]
    raw = bytearray(path.read_bytes())
    for index, value in pokes:
        at = start + begin + index * len(value)
        assert at + len(value) <= start + end, (tensor, index)
        raw[at:at + len(value)] = value
    path.write_bytes(bytes(raw))


def _corrupted_copy(tmp_path: Path, case: str) -> tuple[Path, str, int]:
    fixture, tensor, pokes, count = CORRUPTIONS[case]
    folder = tmp_path / fixture
    shutil.copytree(HF / fixture, folder)
    _corrupt(folder / "model.safetensors", tensor, pokes)
    return folder, tensor, count


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_non_finite_tensor_is_refused_at_load_and_named(tmp_path, case):
    folder, tensor, count = _corrupted_copy(tmp_path, case)
    with pytest.raises(NonFiniteTensorError) as e:
        from_pretrained(folder)
    err, msg = e.value, str(e.value)
    assert isinstance(err, CheckpointFormatError) and isinstance(err, ValueError)
    assert err.tensor == tensor and err.count == count and Path(err.path) == folder / "model.safetensors"
    assert str(folder / "model.safetensors") in msg and repr(tensor) in msg, msg
    assert f"has {count} non-finite value" in msg and "check_finite=False" in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize("case", ["f32-weight", "mxfp4-e8m0-scale", "fp8-scale-inv", "nvfp4-e4m3-scale"])
def test_check_finite_false_loads_the_corrupt_checkpoint(tmp_path, case):
    folder, tensor, _ = _corrupted_copy(tmp_path, case)
    model = from_pretrained(folder, check_finite=False)
    assert model.spec.num_layers >= 1


def test_skipping_the_check_gives_the_nan_logits_it_prevents(tmp_path):
    folder, _, _ = _corrupted_copy(tmp_path, "f32-embed")  # token 0's embedding row holds -inf
    logits = np.asarray(from_pretrained(folder, check_finite=False)(np.array([[0, 5, 7]])))
    assert not np.isfinite(logits).all()


@pytest.mark.parametrize("case", ["mxfp4-e8m0-scale", "fp8-scale-inv", "nvfp4-e4m3-scale"])
def test_dequantize_on_load_path_raises_the_same_error(tmp_path, case):
    folder, tensor, _ = _corrupted_copy(tmp_path, case)
    with pytest.raises(NonFiniteTensorError, match=repr(tensor).replace(".", r"\.")):
        from_pretrained(folder, dequantize=True)


@pytest.mark.parametrize("fixture", sorted(p.name for p in HF.iterdir() if (p / "config.json").is_file()))
def test_unmodified_fixtures_load_with_the_check_and_give_the_same_params(fixture):
    import jax

    checked, unchecked = from_pretrained(HF / fixture), from_pretrained(HF / fixture, check_finite=False)
    a, b = jax.tree_util.tree_leaves(checked.params), jax.tree_util.tree_leaves(unchecked.params)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --------------------------------------------------------------------------------- the reader's rules, per dtype


def _write(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> Path:
    header, data, offset = {}, b"", 0
    for name, (code, a) in tensors.items():
        header[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        data, offset = data + a.tobytes(), offset + a.nbytes
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return path


def _bits(dtype, codes) -> np.ndarray:
    return np.array(codes, np.uint8).view(dtype)


RULES = [  # (name, safetensors dtype, array, non-finite count)
    ("f64", "F64", np.array([1.0, np.nan, -np.inf, 2.0]), 2),
    ("f16", "F16", np.array([1.0, np.inf, 65504.0], np.float16), 1),
    ("bf16", "BF16", np.array([1.0, np.nan, -3.0], ml_dtypes.bfloat16), 1),
    ("e4m3", "F8_E4M3", _bits(ml_dtypes.float8_e4m3fn, [0x7E, 0x7F, 0xFF, 0xFE, 0x00]), 2),  # 0x7E/0xFE: +-448
    ("e5m2", "F8_E5M2", _bits(ml_dtypes.float8_e5m2, [0x7B, 0x7C, 0xFC, 0x7D, 0x01]), 3),
    ("x.down_proj_scales", "U8", np.array([127, 254, 255, 0], np.uint8), 1),  # MXFP4 E8M0: only 0xFF is NaN
    ("x.weight_scale", "U8", np.array([0x7E, 0x7F, 0xFF, 0x38], np.uint8), 2),  # NVFP4 e4m3 scale as bytes
    ("x.weight_packed", "U8", np.array([0xFF, 0x7F], np.uint8), 0),  # E2M1 nibbles: every code is finite
    ("ids", "I32", np.array([-1, 0x7FC00000], np.int32), 0),
]


@pytest.mark.parametrize("name,code,array,count", RULES, ids=[r[0] for r in RULES])
def test_reader_counts_non_finite_codes_per_dtype(tmp_path, name, code, array, count):
    p = _write(tmp_path / "t.safetensors", {name: (code, array), "ok": ("F32", np.ones(3, np.float32))})
    assert count_nonfinite(name, array) == count
    with SafetensorsFile(p) as f:  # the plain reader does not check by default
        assert f.get(name).tobytes() == array.tobytes()
    with SafetensorsFile(p, check_finite=True) as f:
        np.testing.assert_array_equal(f.get("ok"), np.ones(3, np.float32))
        if count:
            with pytest.raises(NonFiniteTensorError, match=f"'{name}'.*has {count} non-finite"):
                f.get(name)
        else:
            assert f.get(name).tobytes() == array.tobytes()
    # the file can still be closed after a refusal


def test_reader_counts_across_chunks(tmp_path, monkeypatch):
    from tutel_jax.checkpoint import _safetensors_io as safetensors_io
    monkeypatch.setattr(safetensors_io, "_CHECK_CHUNK_BYTES", 64)  # 16 float32 per chunk
    a = np.arange(1000, dtype=np.float32).reshape(10, 100)
    a.reshape(-1)[[0, 15, 16, 500, 999]] = [np.nan, np.inf, -np.inf, np.nan, np.inf]
    p = _write(tmp_path / "t.safetensors", {"w": ("F32", a), "b": ("BF16", a.astype(ml_dtypes.bfloat16))})
    with SafetensorsFile(p, check_finite=True) as f:
        for name in ("w", "b"):
            with pytest.raises(NonFiniteTensorError, match="has 5 non-finite value.*of 1000") as e:
                f.get(name)
            assert e.value.count == 5
    assert count_nonfinite("w", a) == 5 and count_nonfinite("w", a.T) == 5


@pytest.mark.parametrize("workers", [2, 3])
def test_reader_reads_large_tensors_in_parts_on_threads(tmp_path, monkeypatch, workers):
    # a tensor of at least twice _PARALLEL_READ_BYTES is read in contiguous parts of whole check chunks, one per
    # thread: the same bytes and the same count as one reader (a part boundary between two bad values included)
    from tutel_jax.checkpoint import _safetensors_io as safetensors_io
    monkeypatch.setattr(safetensors_io, "_CHECK_CHUNK_BYTES", 64)
    monkeypatch.setattr(safetensors_io, "_PARALLEL_READ_BYTES", 256)
    monkeypatch.setattr(safetensors_io, "usable_cpus", lambda: workers)
    a = np.random.default_rng(0).normal(size=(7, 129)).astype(np.float32)  # 3612 bytes: 57 chunks, a short last
    p = _write(tmp_path / "t.safetensors", {"w": ("F32", a), "u": ("U8", a.view(np.uint8))})
    with SafetensorsFile(p, check_finite=True) as f:
        assert f.get("w").tobytes() == a.tobytes() and f.get("u").tobytes() == a.tobytes()
    bad = a.copy()
    # parts of 464 floats (2 workers) or 304 (3 workers): a bad value on each side of every boundary
    bad.reshape(-1)[[0, 303, 304, 463, 464, 607, 608, 902]] = np.nan
    p = _write(tmp_path / "bad.safetensors", {"w": ("F32", bad)})
    with SafetensorsFile(p, check_finite=True) as f, \
            pytest.raises(NonFiniteTensorError, match="has 8 non-finite value.*of 903") as e:
        f.get("w")
    assert e.value.count == 8


# ----------------------------------------------------------------------------------------------------- the CLI


def _cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("tutel-jax")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "tutel_jax.cli"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout, check=False,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))


@pytest.mark.parametrize("case", ["f32-weight", "mxfp4-e8m0-scale"])
def test_generate_cli_prints_one_line_and_exits_2(tmp_path, case):
    folder, tensor, count = _corrupted_copy(tmp_path, case)
    r = _cli("generate", str(folder), "--ids", "1,2,3", "--max-new-tokens", "1")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tutel-jax generate: error: cannot load"), r.stderr
    assert repr(tensor) in lines[0] and f"{count} non-finite" in lines[0] and "check_finite=False" in lines[0]
