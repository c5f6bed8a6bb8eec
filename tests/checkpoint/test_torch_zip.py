"""Tests for tutel_jax.checkpoint._torch_zip: torch.save zip checkpoints without torch.

Most tests need no torch: they read checkpoints that real torch wrote (the Tutel
fixtures) and hand-crafted archives. The ``torch``-marked tests use PyTorch as
an oracle when it is installed and are skipped otherwise.
"""

from __future__ import annotations

import os
import pickle
import pickletools
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from tutel_jax.checkpoint import _torch_zip_write as torch_zip_write
from tutel_jax.checkpoint import (CheckpointFormatError, UnsafeCheckpointError, load_torch_file,
                                            save_torch_file)
from support.paths import TUTEL

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


def _assert_same(actual: np.ndarray, expected: np.ndarray) -> None:
    """Same dtype, shape and bits (bitwise, so NaNs and -0.0 count too)."""
    expected = np.asarray(expected)
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    assert actual.tobytes() == np.ascontiguousarray(expected).tobytes()


# --------------------------------------------------------------------------
# Hand-crafted pickles and archives, independent of the writer under test.
# --------------------------------------------------------------------------


@dataclass
class FakeTensor:
    """Pickles as torch does: _rebuild_tensor_v2(persistent storage id, ...)."""

    storage_type: str  # e.g. "FloatStorage"
    key: str
    numel: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    as_parameter: bool = False


@dataclass
class RawOps:
    """Opcodes spliced verbatim into a crafted pickle."""

    data: bytes


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _encode(obj: Any) -> bytes:
    """Protocol-2 opcodes for ``obj`` (dicts become OrderedDict, like a state dict)."""
    if isinstance(obj, RawOps):
        return obj.data
    if isinstance(obj, FakeTensor):
        pid = (
            pickle.MARK
            + _encode("storage")
            + _global("torch", obj.storage_type)
            + _encode(obj.key)
            + _encode("cpu")
            + _encode(obj.numel)
            + pickle.TUPLE
            + pickle.BINPERSID
        )
        hooks = _global("collections", "OrderedDict") + pickle.EMPTY_TUPLE + pickle.REDUCE
        args = pid + _encode(obj.offset) + _encode(obj.size) + _encode(obj.stride) + pickle.NEWFALSE + hooks
        tensor = _global("torch._utils", "_rebuild_tensor_v2") + pickle.MARK + args + pickle.TUPLE + pickle.REDUCE
        if obj.as_parameter:
            return (
                _global("torch._utils", "_rebuild_parameter")
                + pickle.MARK
                + tensor
                + pickle.NEWTRUE
                + hooks
                + pickle.TUPLE
                + pickle.REDUCE
            )
        return tensor
    if isinstance(obj, dict):
        body = b"".join(_encode(k) + _encode(v) for k, v in obj.items())
        return _global("collections", "OrderedDict") + pickle.EMPTY_TUPLE + pickle.REDUCE + pickle.MARK + body + pickle.SETITEMS
    if isinstance(obj, list):
        return pickle.EMPTY_LIST + pickle.MARK + b"".join(map(_encode, obj)) + pickle.APPENDS
    if isinstance(obj, tuple):
        return pickle.MARK + b"".join(map(_encode, obj)) + pickle.TUPLE
    if isinstance(obj, str):
        data = obj.encode()
        return pickle.BINUNICODE + struct.pack("<I", len(data)) + data
    if isinstance(obj, (bool, int, float, type(None))):
        return pickle.dumps(obj, protocol=2)[2:-1]  # never memoized, so no BINPUT to strip
    raise TypeError(type(obj))


def _crafted_pickle(obj: Any) -> bytes:
    return pickle.PROTO + b"\x02" + _encode(obj) + pickle.STOP


def _write_zip(path: Path, entries: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    return path


def _write_checkpoint(
    path: Path,
    obj: Any,
    storages: dict[str, bytes],
    *,
    top: str = "archive",
    byteorder: bytes | None = b"little",
    pickle_bytes: bytes | None = None,
) -> Path:
    """A torch-layout archive with a crafted data.pkl and the given storages."""
    entries = {f"{top}/data.pkl": _crafted_pickle(obj) if pickle_bytes is None else pickle_bytes}
    if byteorder is not None:
        entries[f"{top}/byteorder"] = byteorder
    entries.update({f"{top}/data/{key}": data for key, data in storages.items()})
    entries[f"{top}/version"] = b"3\n"
    return _write_zip(path, entries)


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
        _assert_same(array, expected[key])


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
        _assert_same(loaded[key], array)


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
        _assert_same(loaded[key], np.asarray(array))


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
    _assert_same(load_torch_file(path)["a"], np.zeros(2))


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
    _assert_same(load_torch_file(path)["old"], np.arange(4))


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
    path = _write_checkpoint(tmp_path / "views.pt", obj, {"0": storage.tobytes()})

    loaded = load_torch_file(path)

    full = storage.reshape(3, 4)
    _assert_same(loaded["full"], full)
    _assert_same(loaded["row1"], full[1])
    _assert_same(loaded["transposed"], full.T)
    _assert_same(loaded["broadcast"], np.stack([storage[5:8]] * 2))
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
    loaded = load_torch_file(_write_checkpoint(tmp_path / "nested.pt", obj, storages))

    assert list(loaded) == ["model.layer.w", "epoch", "lr", "ema", "blocks.0", "param"]
    _assert_same(loaded["model.layer.w"], np.array([1.5, -2], np.float16))
    _assert_same(loaded["epoch"], np.array(3, np.int64))
    _assert_same(loaded["lr"], np.array(0.5, np.float64))
    _assert_same(loaded["ema"], np.array(True))
    _assert_same(loaded["blocks.0"], np.array(9, np.int64))
    _assert_same(loaded["param"], np.array([3], ml_dtypes.bfloat16))


def test_state_dict_metadata_attribute_is_ignored(tmp_path: Path) -> None:
    # nn.Module.state_dict() pickles `_metadata` onto the OrderedDict with BUILD.
    tensor = FakeTensor("IntStorage", "0", 1, 0, (1,), (1,))
    body = _encode({"w": tensor})
    build = _encode({"_metadata": {"": {"version": 1}}}).replace(
        _global("collections", "OrderedDict") + pickle.EMPTY_TUPLE + pickle.REDUCE, pickle.EMPTY_DICT, 1
    )
    data = pickle.PROTO + b"\x02" + body + build + pickle.BUILD + pickle.STOP
    path = _write_checkpoint(tmp_path / "meta.pt", None, {"0": np.array([4], np.int32).tobytes()}, pickle_bytes=data)
    loaded = load_torch_file(path)
    assert list(loaded) == ["w"]
    _assert_same(loaded["w"], np.array([4], np.int32))


def test_missing_byteorder_record_means_little_endian(tmp_path: Path) -> None:
    obj = {"w": FakeTensor("ShortStorage", "0", 2, 0, (2,), (1,))}
    path = _write_checkpoint(tmp_path / "old.pt", obj, {"0": np.array([1, -1], "<i2").tobytes()}, byteorder=None)
    _assert_same(load_torch_file(path)["w"], np.array([1, -1], np.int16))


# --------------------------------------------------------------------------
# Malicious pickles never execute.
# --------------------------------------------------------------------------


def _os_system_pickle(command: str) -> bytes:
    return pickle.PROTO + b"\x02" + _global("os", "system") + _encode((command,)) + pickle.REDUCE + pickle.STOP


class _Exploit:
    """The usual exploit: pickle.dumps emits STACK_GLOBAL/GLOBAL for os.system."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.command,))


@pytest.mark.parametrize("protocol", ["crafted-GLOBAL", 2, 4])
def test_os_system_payload_is_refused_and_never_runs(tmp_path: Path, protocol: Any) -> None:
    marker = tmp_path / "pwned"
    command = f"touch '{marker}'"
    if protocol == "crafted-GLOBAL":
        data = _os_system_pickle(command)
    else:
        data = pickle.dumps({"w": _Exploit(command)}, protocol=protocol)
    path = _write_checkpoint(tmp_path / "evil.pt", None, {}, pickle_bytes=data)

    with pytest.raises(UnsafeCheckpointError, match=r"(os|posix|nt)\.system") as info:
        load_torch_file(path)

    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)
    assert not marker.exists()


def test_builtins_eval_payload_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    expression = f"open({str(marker)!r}, 'w').close()"
    data = pickle.PROTO + b"\x02" + _global("builtins", "eval") + _encode((expression,)) + pickle.REDUCE + pickle.STOP
    path = _write_checkpoint(tmp_path / "evil.pt", None, {}, pickle_bytes=data)

    with pytest.raises(UnsafeCheckpointError, match=r"builtins\.eval"):
        load_torch_file(path)
    assert not marker.exists()


def test_payload_hidden_as_storage_type_is_refused(tmp_path: Path) -> None:
    tensor = FakeTensor("FloatStorage", "0", 1, 0, (1,), (1,))
    data = _crafted_pickle({"w": tensor}).replace(_global("torch", "FloatStorage"), _global("subprocess", "Popen"))
    path = _write_checkpoint(tmp_path / "evil.pt", None, {"0": b"\0" * 4}, pickle_bytes=data)
    with pytest.raises(UnsafeCheckpointError, match=r"subprocess\.Popen"):
        load_torch_file(path)


# --------------------------------------------------------------------------
# Malformed files raise CheckpointFormatError naming the file.
# --------------------------------------------------------------------------


def _expect_format_error(path: Path, match: str) -> CheckpointFormatError:
    with pytest.raises(CheckpointFormatError, match=match) as info:
        load_torch_file(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)
    return info.value


def test_missing_file(tmp_path: Path) -> None:
    _expect_format_error(tmp_path / "nope.pt", "does not exist")


def test_directory_instead_of_file(tmp_path: Path) -> None:
    _expect_format_error(tmp_path, "does not exist")


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.pt"
    path.write_bytes(b"")
    _expect_format_error(path, "empty")


def test_random_bytes(tmp_path: Path) -> None:
    path = tmp_path / "random.pt"
    path.write_bytes(np.random.default_rng(1).bytes(4096))
    _expect_format_error(path, "not a zip")


def test_legacy_non_zip_torch_format(tmp_path: Path) -> None:
    # torch < 1.6 (or _use_new_zipfile_serialization=False) starts with a pickled magic number.
    path = tmp_path / "legacy.pt"
    path.write_bytes(pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2) + pickle.dumps(1001, protocol=2))
    _expect_format_error(path, "legacy")


@pytest.mark.parametrize("fraction", [0.5, 0.9, 0.999])
def test_truncated_fixture(tmp_path: Path, fraction: float) -> None:
    data = (TUTEL / "top2_cf1" / "state_dict.pt").read_bytes()
    path = tmp_path / "truncated.pt"
    path.write_bytes(data[: int(len(data) * fraction)])
    _expect_format_error(path, "truncated|corrupt|not a zip")


def test_corrupted_storage_bytes_fail_crc(tmp_path: Path) -> None:
    path = tmp_path / "flipped.pt"
    save_torch_file(path, {"a": np.arange(64, dtype=np.float32)})
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("flipped/data/0")
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26 : info.header_offset + 30])
    raw[info.header_offset + 30 + name_len + extra_len + 10] ^= 0xFF
    path.write_bytes(bytes(raw))
    _expect_format_error(path, "CRC|malformed")


def test_zip_without_data_pkl(tmp_path: Path) -> None:
    path = _write_zip(tmp_path / "nopkl.pt", {"archive/data/0": b"\0" * 4, "archive/version": b"3\n"})
    _expect_format_error(path, "data.pkl")


@pytest.mark.parametrize("tensor, storages, byteorder, match", [
    pytest.param(("FloatStorage", "7", 4, 0, (4,), (1,)), {"0": b"\0" * 16}, b"little", "storage '7'.*missing",
                 id="storage_entry_missing"),
    pytest.param(("FloatStorage", "0", 4, 0, (4,), (1,)), {"0": b"\0" * 12}, b"little", "12 bytes",
                 id="storage_shorter_than_declared"),
    pytest.param(("FloatStorage", "0", 4, 2, (2, 2), (2, 1)), {"0": b"\0" * 16}, b"little", "reads element 5",
                 id="view_reaching_past_storage_end"),
    pytest.param(("ComplexFloatStorage", "0", 1, 0, (1,), (1,)), {"0": b"\0" * 8}, b"little",
                 "unsupported dtype.*ComplexFloatStorage", id="unsupported_dtype_storage"),
    pytest.param(("FloatStorage", "0", 1, 0, (1,), (1,)), {"0": b"\0" * 4}, b"big", "big-endian",
                 id="big_endian_archive"),
])
def test_malformed_storage_is_refused(tmp_path: Path, tensor, storages, byteorder, match) -> None:
    path = _write_checkpoint(tmp_path / "bad.pt", {"w": FakeTensor(*tensor)}, storages, byteorder=byteorder)
    _expect_format_error(path, match)


@pytest.mark.parametrize(
    ("obj", "match"),
    [
        ([1, 2], "list"),
        (FakeTensor("FloatStorage", "0", 1, 0, (1,), (1,)), "_TensorRecord|expected a dict"),
        ({"w": {1.5: 2}}, "not a string"),
        ({"w": [1, RawOps(pickle.EMPTY_SET + pickle.MARK + _encode(1) + pickle.ADDITEMS)]}, "unsupported value of type set"),
    ],
    ids=["list", "bare-tensor", "float-key", "odd-leaf"],
)
def test_pickle_that_is_not_a_state_dict(tmp_path: Path, obj: Any, match: str) -> None:
    path = _write_checkpoint(tmp_path / "notdict.pt", obj, {"0": b"\0" * 4})
    _expect_format_error(path, match)


def test_garbage_pickle(tmp_path: Path) -> None:
    path = _write_checkpoint(tmp_path / "garbage.pt", None, {}, pickle_bytes=b"\x80\x02garbage")
    _expect_format_error(path, "malformed")


def test_malformed_tensor_arguments(tmp_path: Path) -> None:
    obj = {"w": FakeTensor("FloatStorage", "0", 1, 0, (1, -1), (1, 1))}
    path = _write_checkpoint(tmp_path / "neg.pt", obj, {"0": b"\0" * 4})
    _expect_format_error(path, "non-negative")


# --------------------------------------------------------------------------
# Views that claim more memory than their storage (a tiny file must not exhaust memory).
# --------------------------------------------------------------------------

HUGE = (20000, 20000)  # 4e8 float32 elements: 1.6 GB as an array


def _stride0_bomb(path: Path, size: tuple[int, ...] = HUGE, value: float = 2.5) -> Path:
    """A few-hundred-byte checkpoint: one float storage, viewed as `size` with all strides 0."""
    obj = {"bomb": FakeTensor("FloatStorage", "0", 1, 0, size, (0,) * len(size))}
    return _write_checkpoint(path, obj, {"0": np.array([value], np.float32).tobytes()})


def test_stride0_view_bigger_than_its_storage_is_refused_without_allocating(tmp_path: Path) -> None:
    import tracemalloc

    path = _stride0_bomb(tmp_path / "bomb.pt")
    assert path.stat().st_size < 1024
    tracemalloc.start()
    try:
        err = _expect_format_error(path, "allow_expanding_views")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, peak  # nothing near the 1.6 GB the view would take
    msg = str(err)
    for part in ("'bomb'", "size (20000, 20000)", "stride (0, 0)", "400000000 elements", "holds only 1",
                 "allow_expanding_views=True"):
        assert part in msg, msg


def test_expanding_view_opt_in_is_a_read_only_broadcast_without_copy(tmp_path: Path) -> None:
    import tracemalloc

    small = load_torch_file(_stride0_bomb(tmp_path / "small.pt", (3, 4)), allow_expanding_views=True)["bomb"]
    np.testing.assert_array_equal(small, np.broadcast_to(np.float32(2.5), (3, 4)))
    assert small.dtype == np.float32 and small.shape == (3, 4)
    assert not small.flags.writeable
    with pytest.raises(ValueError):
        small[0, 0] = 1.0

    path = _stride0_bomb(tmp_path / "bomb.pt")
    tracemalloc.start()
    try:
        huge = load_torch_file(path, allow_expanding_views=True)["bomb"]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, peak  # a view of the 4-byte storage, not a 1.6 GB copy
    assert huge.shape == HUGE and huge.strides == (0, 0) and not huge.flags.writeable
    assert huge[12345, 19999] == np.float32(2.5)


def test_partly_broadcast_view_within_its_storage_is_still_copied(tmp_path: Path) -> None:
    # 2 x 3 elements, stride (0, 1), over a 12-element storage: no bigger than the storage, so allowed
    storage = np.arange(12, dtype=np.float32)
    obj = {"b": FakeTensor("FloatStorage", "0", 12, 5, (2, 3), (0, 1)),
           "over": FakeTensor("FloatStorage", "0", 12, 0, (4, 4), (1, 1))}  # 16 > 12 elements: overlapping
    path = _write_checkpoint(tmp_path / "b.pt", obj, {"0": storage.tobytes()})
    err = _expect_format_error(path, "'over'.*16 elements.*holds only 12")
    assert "'b'" not in str(err)
    loaded = load_torch_file(path, allow_expanding_views=True)
    _assert_same(loaded["b"], np.stack([storage[5:8]] * 2))
    assert loaded["b"].flags.owndata and loaded["b"].flags.writeable  # within the storage: an owned copy
    np.testing.assert_array_equal(loaded["over"], np.add.outer(np.arange(4), np.arange(4)).astype(np.float32))


def test_non_contiguous_views_load_exactly(tmp_path: Path) -> None:
    n = 5
    storage = np.arange(3 * n, dtype=np.float32)
    obj = {"t": FakeTensor("FloatStorage", "0", 3 * n, 0, (n, 3), (1, n)),  # a transposed [3, n]
           "every_other": FakeTensor("FloatStorage", "0", 3 * n, 1, (2, 2), (n, 2))}
    loaded = load_torch_file(_write_checkpoint(tmp_path / "t.pt", obj, {"0": storage.tobytes()}))
    _assert_same(loaded["t"], storage.reshape(3, n).T)
    _assert_same(loaded["every_other"], storage.reshape(3, n)[:2, 1:5:2])
    assert all(a.flags.owndata and a.flags.c_contiguous for a in loaded.values())


@pytest.mark.parametrize(
    ("offset", "size", "stride", "match"),
    [
        (9, (0,), (1,), "starts past the end of storage '0', which holds only 4"),
        (5, (1,), (1,), "starts past the end"),
        (0, (2, 2), (3, 1), "reads element 4 but storage '0' holds only 4"),
        (0, (2,), (-1,), "stride .*non-negative"),
        (-1, (1,), (1,), "offset -1 is not a non-negative int"),
    ],
    ids=["empty-offset-past-end", "offset-past-end", "last-past-end", "negative-stride", "negative-offset"],
)
def test_views_outside_their_storage_are_refused(tmp_path: Path, offset: int, size: tuple, stride: tuple,
                                                 match: str) -> None:
    obj = {"w": FakeTensor("FloatStorage", "0", 4, offset, size, stride)}
    path = _write_checkpoint(tmp_path / "oob.pt", obj, {"0": b"\0" * 16})
    _expect_format_error(path, match)
    with pytest.raises(CheckpointFormatError, match=match):
        load_torch_file(path, allow_expanding_views=True)  # the opt-in never relaxes the bounds


def test_callers_of_load_torch_file_surface_the_expanding_view_error(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    from tutel_jax.checkpoint.__main__ import main as checkpoint_cli
    from tutel_jax.checkpoint._tutel_format import read_state_dict

    path = _stride0_bomb(tmp_path / "bomb.pt")
    with pytest.raises(CheckpointFormatError, match="'bomb'.*allow_expanding_views"):
        read_state_dict(path)
    rc = checkpoint_cli(["scatter", f"--input={path}", "--output_size=2", f"--outputs={tmp_path}/r{{rank}}.pt"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "'bomb'" in err[0] and "allow_expanding_views" in err[0], err


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
            _assert_same(_torch_to_numpy(torch, tensor), array)


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
        _assert_same(loaded[key], _torch_to_numpy(torch, tensor.detach()))


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
        _assert_same(loaded[key], array)
    _assert_same(loaded["epoch"], np.array(2, np.int64))


@pytest.mark.torch
def test_torch_saved_stride0_view_is_refused_then_loaded_on_request(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch", reason=_TORCH_REASON)
    path = tmp_path / "bomb.pt"
    torch.save({"bomb": torch.full((1,), 2.5).as_strided(HUGE, (0, 0)),
                "t": torch.arange(12.0).reshape(3, 4).t()}, path)
    assert path.stat().st_size < 4096
    _expect_format_error(path, "'bomb'.*size \\(20000, 20000\\), stride \\(0, 0\\).*allow_expanding_views")
    loaded = load_torch_file(path, allow_expanding_views=True)
    assert loaded["bomb"].shape == HUGE and loaded["bomb"].strides == (0, 0)
    assert loaded["bomb"][7, 19999] == np.float32(2.5)
    _assert_same(loaded["t"], np.arange(12.0, dtype=np.float32).reshape(3, 4).T)
