"""Tests for tutel_jax.checkpoint._torch_zip: torch.save zip checkpoints without torch, read and written.

Most tests need no torch: they read checkpoints that real torch wrote (the Tutel fixtures) and hand-crafted
archives (`support.torch_pickles`). The ``torch``-marked tests use PyTorch as an oracle when it is installed and
are skipped otherwise. What the reader refuses (malicious pickles, malformed files, views larger than their
storage) is `test_torch_zip_refusals.py`.
"""

from __future__ import annotations

import pickle
import pickletools
import struct
import zipfile
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from support.paths import TUTEL
from support.torch_pickles import FakeTensor, assert_same_bits, encode, global_op, write_checkpoint
from tutel_jax.checkpoint import _torch_zip_write as torch_zip_write
from tutel_jax.checkpoint import load_torch_file, save_torch_file

CASES = [
    "top1_cf1",
    "top2_cf1",
    "top2_cf0_dropless",
    "top2_cfneg0.5",
    "top2_cf0.5_drops",
    "top2_prescore",
    "top3_cf1",
]
SUPPORTED_DTYPES = [
    np.float32,
    np.float64,
    np.float16,
    ml_dtypes.bfloat16,
    np.int64,
    np.int32,
    np.int16,
    np.int8,
    np.uint8,
    np.bool_,
]


def _random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Random values covering each dtype's range (incl. negatives and fractions)."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return (rng.standard_normal(shape) * 100).astype(dtype)


# --------------------------------------------------------------------------
# Reading real torch.save output (the Tutel fixtures).
# --------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_fixture_state_dict_matches_npy_params(case: str) -> None:
    case_dir = TUTEL / case
    expected = {p.name[: -len(".npy")]: np.load(p) for p in sorted((case_dir / "params").glob("*.npy"))}
    assert expected, f"no params/*.npy in {case_dir}"

    loaded = load_torch_file(case_dir / "state_dict.pt")

    assert set(loaded) == set(expected)
    for key, array in loaded.items():
        assert_same_bits(array, expected[key])


def test_fixture_arrays_are_owned_writable_copies() -> None:
    loaded = load_torch_file(str(TUTEL / "top1_cf1" / "state_dict.pt"))
    for array in loaded.values():
        assert array.flags.owndata and array.flags.writeable and array.flags.c_contiguous
    scalar = loaded["_num_global_experts"]
    assert scalar.ndim == 0 and scalar.dtype == np.int64


# --------------------------------------------------------------------------
# Round trips through save_torch_file.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=lambda d: np.dtype(d).name)
def test_round_trip_every_dtype_and_shape(tmp_path: Path, dtype: Any) -> None:
    rng = np.random.default_rng(0)
    base = _random_array(rng, (6, 5), dtype)
    tensors = {
        "matrix": base,
        "scalar": _random_array(rng, (), dtype),
        "empty": np.zeros((0, 3), dtype=dtype),
        "empty_last": np.zeros((3, 0), dtype=dtype),
        "transposed": base.T,  # non-contiguous source
        "strided": base[::2, ::-2],  # steps and a negative stride
        "rank4": _random_array(rng, (2, 1, 3, 2), dtype),
    }
    path = tmp_path / "weights.pt"

    save_torch_file(path, tensors)
    loaded = load_torch_file(path)

    assert list(loaded) == list(tensors)
    for key, array in tensors.items():
        assert_same_bits(loaded[key], array)


def test_round_trip_jax_arrays(tmp_path: Path) -> None:
    jnp = pytest.importorskip("jax.numpy")
    tensors = {
        "w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4),
        "b": jnp.ones((4,), dtype=jnp.bfloat16),
        "step": jnp.asarray(7, dtype=jnp.int32),
    }
    save_torch_file(tmp_path / "jax.pt", tensors)
    loaded = load_torch_file(tmp_path / "jax.pt")
    for key, array in tensors.items():
        assert_same_bits(loaded[key], np.asarray(array))


def test_round_trip_big_endian_input_is_stored_little_endian(tmp_path: Path) -> None:
    source = np.arange(5, dtype=">i4")
    save_torch_file(tmp_path / "be.pt", {"x": source})
    loaded = load_torch_file(tmp_path / "be.pt")["x"]
    assert loaded.dtype == np.int32 and loaded.tolist() == source.tolist()


def test_round_trip_empty_mapping(tmp_path: Path) -> None:
    save_torch_file(tmp_path / "none.pt", {})
    assert load_torch_file(tmp_path / "none.pt") == {}


def test_written_layout_mimics_torch(tmp_path: Path) -> None:
    path = tmp_path / "my_model.pt"
    save_torch_file(path, {"a": np.ones((3, 3), np.float32), "b": np.arange(3)})

    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        names = [info.filename for info in infos]
        assert names == [
            "my_model/data.pkl",
            "my_model/.format_version",
            "my_model/.storage_alignment",
            "my_model/byteorder",
            "my_model/data/0",
            "my_model/data/1",
            "my_model/version",
            "my_model/.data/serialization_id",
        ]
        assert zf.read("my_model/byteorder") == b"little"
        assert zf.read("my_model/version") == b"3\n"
        assert zf.read("my_model/.format_version") == b"1"
        assert zf.read("my_model/.storage_alignment") == b"64"
        serialization_id = zf.read("my_model/.data/serialization_id")
        assert len(serialization_id) == 40 and serialization_id.isdigit()
        globals_used = {arg for op, arg, _ in pickletools.genops(zf.read("my_model/data.pkl")) if op.name == "GLOBAL"}
        assert globals_used == {
            "collections OrderedDict",
            "torch._utils _rebuild_tensor_v2",
            "torch FloatStorage",
            "torch LongStorage",
        }

    raw = path.read_bytes()
    for info in infos:
        assert info.compress_type == zipfile.ZIP_STORED
        # Local header: 30 fixed bytes, then name and extra field, then the data.
        name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26 : info.header_offset + 30])
        assert (info.header_offset + 30 + name_len + extra_len) % 64 == 0, info.filename


def test_archive_name_can_be_chosen(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    save_torch_file(path, {"a": np.zeros(2)}, archive_name="archive")
    with zipfile.ZipFile(path) as zf:
        assert all(name.startswith("archive/") for name in zf.namelist())
    assert_same_bits(load_torch_file(path)["a"], np.zeros(2))


@pytest.mark.parametrize("bad_name", ["", "a/b", "..", "a\\b"])
def test_archive_name_must_be_a_plain_name(tmp_path: Path, bad_name: str) -> None:
    with pytest.raises(ValueError, match="archive_name"):
        save_torch_file(tmp_path / "x.pt", {"a": np.zeros(2)}, archive_name=bad_name)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "value",
    [np.zeros(2, np.complex64), np.zeros(2, np.uint16), np.zeros(2, ml_dtypes.float8_e4m3fn), np.array(["s"])],
    ids=["complex64", "uint16", "float8", "str"],
)
def test_save_rejects_unsupported_dtypes_without_writing(tmp_path: Path, value: np.ndarray) -> None:
    with pytest.raises(TypeError, match="unsupported dtype"):
        save_torch_file(tmp_path / "x.pt", {"a": value})
    assert list(tmp_path.iterdir()) == []


def test_save_rejects_non_string_names(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="names must be str"):
        save_torch_file(tmp_path / "x.pt", {1: np.zeros(2)})  # type: ignore[dict-item]


# --------------------------------------------------------------------------
# Atomic writes.
# --------------------------------------------------------------------------


def test_failed_write_keeps_previous_file_and_leaves_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt.pt"
    save_torch_file(path, {"old": np.arange(4)})
    before = path.read_bytes()

    real_write = torch_zip_write._write_aligned

    def failing_write(zf: Any, fh: Any, name: str, data: Any) -> None:
        if name.endswith("/data/1"):
            raise OSError("disk full (simulated)")
        real_write(zf, fh, name, data)

    monkeypatch.setattr(torch_zip_write, "_write_aligned", failing_write)
    with pytest.raises(OSError, match="simulated"):
        save_torch_file(path, {"new0": np.ones(3), "new1": np.ones(3)})

    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
    assert_same_bits(load_torch_file(path)["old"], np.arange(4))


def test_failed_rename_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_replace(src: Any, dst: Any) -> None:
        raise OSError("rename failed (simulated)")

    monkeypatch.setattr(torch_zip_write.os, "replace", failing_replace)
    with pytest.raises(OSError, match="simulated"):
        save_torch_file(tmp_path / "ckpt.pt", {"a": np.ones(3)})
    assert list(tmp_path.iterdir()) == []


def test_overwrite_replaces_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    save_torch_file(path, {"a": np.ones(3)})
    save_torch_file(path, {"b": np.zeros(2, np.int8)})
    assert list(load_torch_file(path)) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


# --------------------------------------------------------------------------
# Reader features on crafted archives.
# --------------------------------------------------------------------------


def test_views_sharing_one_storage(tmp_path: Path) -> None:
    storage = np.arange(12, dtype=np.float32)
    obj = {
        "full": FakeTensor("FloatStorage", "0", 12, 0, (3, 4), (4, 1)),
        "row1": FakeTensor("FloatStorage", "0", 12, 4, (4,), (1,)),
        "transposed": FakeTensor("FloatStorage", "0", 12, 0, (4, 3), (1, 4)),
        "broadcast": FakeTensor("FloatStorage", "0", 12, 5, (2, 3), (0, 1)),
    }
    path = write_checkpoint(tmp_path / "views.pt", obj, {"0": storage.tobytes()})

    loaded = load_torch_file(path)

    full = storage.reshape(3, 4)
    assert_same_bits(loaded["full"], full)
    assert_same_bits(loaded["row1"], full[1])
    assert_same_bits(loaded["transposed"], full.T)
    assert_same_bits(loaded["broadcast"], np.stack([storage[5:8]] * 2))
    assert all(a.flags.owndata and a.flags.c_contiguous for a in loaded.values())
    loaded["full"][0, 0] = 100  # copies, so the views do not alias
    assert loaded["transposed"][0, 0] == 0


def test_nested_mappings_are_flattened_and_scalars_kept(tmp_path: Path) -> None:
    obj = {
        "model": {"layer": {"w": FakeTensor("HalfStorage", "0", 2, 0, (2,), (1,))}},
        "epoch": 3,
        "lr": 0.5,
        "ema": True,
        "name": "skipped",
        "nothing": None,
        "blocks": [FakeTensor("LongStorage", "1", 1, 0, (), ())],
        "param": FakeTensor("BFloat16Storage", "2", 1, 0, (1,), (1,), as_parameter=True),
    }
    storages = {
        "0": np.array([1.5, -2], np.float16).tobytes(),
        "1": np.array([9], np.int64).tobytes(),
        "2": np.array([3], ml_dtypes.bfloat16).tobytes(),
    }
    loaded = load_torch_file(write_checkpoint(tmp_path / "nested.pt", obj, storages))

    assert list(loaded) == ["model.layer.w", "epoch", "lr", "ema", "blocks.0", "param"]
    assert_same_bits(loaded["model.layer.w"], np.array([1.5, -2], np.float16))
    assert_same_bits(loaded["epoch"], np.array(3, np.int64))
    assert_same_bits(loaded["lr"], np.array(0.5, np.float64))
    assert_same_bits(loaded["ema"], np.array(True))
    assert_same_bits(loaded["blocks.0"], np.array(9, np.int64))
    assert_same_bits(loaded["param"], np.array([3], ml_dtypes.bfloat16))


def test_state_dict_metadata_attribute_is_ignored(tmp_path: Path) -> None:
    # nn.Module.state_dict() pickles `_metadata` onto the OrderedDict with BUILD.
    tensor = FakeTensor("IntStorage", "0", 1, 0, (1,), (1,))
    body = encode({"w": tensor})
    build = encode({"_metadata": {"": {"version": 1}}}).replace(
        global_op("collections", "OrderedDict") + pickle.EMPTY_TUPLE + pickle.REDUCE, pickle.EMPTY_DICT, 1
    )
    data = pickle.PROTO + b"\x02" + body + build + pickle.BUILD + pickle.STOP
    path = write_checkpoint(tmp_path / "meta.pt", None, {"0": np.array([4], np.int32).tobytes()}, pickle_bytes=data)
    loaded = load_torch_file(path)
    assert list(loaded) == ["w"]
    assert_same_bits(loaded["w"], np.array([4], np.int32))


def test_missing_byteorder_record_means_little_endian(tmp_path: Path) -> None:
    obj = {"w": FakeTensor("ShortStorage", "0", 2, 0, (2,), (1,))}
    path = write_checkpoint(tmp_path / "old.pt", obj, {"0": np.array([1, -1], "<i2").tobytes()}, byteorder=None)
    assert_same_bits(load_torch_file(path)["w"], np.array([1, -1], np.int16))


# --------------------------------------------------------------------------
# Optional: PyTorch itself as the oracle.
# --------------------------------------------------------------------------

_TORCH_REASON = "PyTorch not installed: optional torch.load round-trip oracle"


def _torch_dtype(torch: Any, dtype: Any) -> Any:
    return {
        "float32": torch.float32,
        "float64": torch.float64,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "int64": torch.int64,
        "int32": torch.int32,
        "int16": torch.int16,
        "int8": torch.int8,
        "uint8": torch.uint8,
        "bool": torch.bool,
    }[np.dtype(dtype).name]


def _torch_to_numpy(torch: Any, tensor: Any) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        return tensor.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


@pytest.mark.torch
def test_torch_load_reads_save_torch_file(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch", reason=_TORCH_REASON)
    rng = np.random.default_rng(3)
    tensors: dict[str, np.ndarray] = {}
    for dtype in SUPPORTED_DTYPES:
        name = np.dtype(dtype).name
        tensors[f"{name}.matrix"] = _random_array(rng, (4, 3), dtype)
        tensors[f"{name}.scalar"] = _random_array(rng, (), dtype)
        tensors[f"{name}.empty"] = np.zeros((0, 2), dtype)
        tensors[f"{name}.transposed"] = _random_array(rng, (3, 5), dtype).T
    path = tmp_path / "ours.pt"
    save_torch_file(path, tensors)

    for mmap in (False, True):
        loaded = torch.load(path, weights_only=True, mmap=mmap)
        assert isinstance(loaded, dict) and list(loaded) == list(tensors)
        for key, array in tensors.items():
            tensor = loaded[key]
            assert tensor.dtype == _torch_dtype(torch, array.dtype), key
            assert tuple(tensor.shape) == array.shape, key
            assert_same_bits(_torch_to_numpy(torch, tensor), array)


@pytest.mark.torch
def test_load_torch_file_reads_torch_save(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch", reason=_TORCH_REASON)
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(5, 7, generator=generator)
    state = {
        "weight": base,
        "transposed": torch.randn(4, 6, generator=generator).t(),
        "row_view": base[2],  # shares base's storage with an offset
        "bf16": torch.randn(3, 2, generator=generator).to(torch.bfloat16),
        "half": torch.randn(3, generator=generator).half(),
        "double": torch.randn(2, 2, generator=generator, dtype=torch.float64),
        "long": torch.randint(-(2**40), 2**40, (5,), generator=generator),
        "int": torch.randint(-100, 100, (2, 3), generator=generator, dtype=torch.int32),
        "short": torch.randint(-100, 100, (3,), generator=generator, dtype=torch.int16),
        "char": torch.randint(-100, 100, (3,), generator=generator, dtype=torch.int8),
        "byte": torch.randint(0, 255, (3,), generator=generator, dtype=torch.uint8),
        "bool": torch.rand(4, generator=generator) > 0.5,
        "scalar": torch.tensor(42),
        "empty": torch.zeros(0, 3),
        "param": torch.nn.Parameter(torch.randn(2, 2, generator=generator)),
    }
    path = tmp_path / "theirs.pt"
    torch.save(state, path)

    loaded = load_torch_file(path)

    assert list(loaded) == list(state)
    for key, tensor in state.items():
        assert_same_bits(loaded[key], _torch_to_numpy(torch, tensor.detach()))


@pytest.mark.torch
def test_load_torch_file_reads_module_state_dict(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch", reason=_TORCH_REASON)
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    path = tmp_path / "module.pt"
    torch.save({"model": module.state_dict(), "epoch": 2}, path)

    loaded = load_torch_file(path)

    expected = {f"model.{k}": _torch_to_numpy(torch, v) for k, v in module.state_dict().items()}
    assert list(loaded) == [*expected, "epoch"]
    for key, array in expected.items():
        assert_same_bits(loaded[key], array)
    assert_same_bits(loaded["epoch"], np.array(2, np.int64))
