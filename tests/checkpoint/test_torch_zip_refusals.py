"""What `tutel_jax.checkpoint.load_torch_file` refuses, each on a hand-crafted or damaged `torch.save` archive
(`support.torch_pickles`): malicious pickles (never executed), malformed files (CheckpointFormatError naming the
file), and views that claim more memory than their storage (refused before allocating). Hostile zip containers
(deflate bombs, huge memos) are `test_hostile_pt.py`."""

from __future__ import annotations

import os
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from support.paths import TUTEL
from support.torch_pickles import FakeTensor, RawOps, assert_same_bits, crafted_pickle, encode, global_op, \
    write_checkpoint, write_zip
from tutel_jax.checkpoint import CheckpointFormatError, UnsafeCheckpointError, load_torch_file, save_torch_file


# --------------------------------------------------------------------------
# Malicious pickles never execute.
# --------------------------------------------------------------------------


def _os_system_pickle(command: str) -> bytes:
    return pickle.PROTO + b"\x02" + global_op("os", "system") + encode((command,)) + pickle.REDUCE + pickle.STOP


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
    path = write_checkpoint(tmp_path / "evil.pt", None, {}, pickle_bytes=data)

    with pytest.raises(UnsafeCheckpointError, match=r"(os|posix|nt)\.system") as info:
        load_torch_file(path)

    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)
    assert not marker.exists()


def test_builtins_eval_payload_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    expression = f"open({str(marker)!r}, 'w').close()"
    data = pickle.PROTO + b"\x02" + global_op("builtins", "eval") + encode((expression,)) + pickle.REDUCE + pickle.STOP
    path = write_checkpoint(tmp_path / "evil.pt", None, {}, pickle_bytes=data)

    with pytest.raises(UnsafeCheckpointError, match=r"builtins\.eval"):
        load_torch_file(path)
    assert not marker.exists()


def test_payload_hidden_as_storage_type_is_refused(tmp_path: Path) -> None:
    tensor = FakeTensor("FloatStorage", "0", 1, 0, (1,), (1,))
    data = crafted_pickle({"w": tensor}).replace(global_op("torch", "FloatStorage"), global_op("subprocess", "Popen"))
    path = write_checkpoint(tmp_path / "evil.pt", None, {"0": b"\0" * 4}, pickle_bytes=data)
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
    path = write_zip(tmp_path / "nopkl.pt", {"archive/data/0": b"\0" * 4, "archive/version": b"3\n"})
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
    path = write_checkpoint(tmp_path / "bad.pt", {"w": FakeTensor(*tensor)}, storages, byteorder=byteorder)
    _expect_format_error(path, match)


@pytest.mark.parametrize(
    ("obj", "match"),
    [
        ([1, 2], "list"),
        (FakeTensor("FloatStorage", "0", 1, 0, (1,), (1,)), "_TensorRecord|expected a dict"),
        ({"w": {1.5: 2}}, "not a string"),
        ({"w": [1, RawOps(pickle.EMPTY_SET + pickle.MARK + encode(1) + pickle.ADDITEMS)]}, "unsupported value of type set"),
    ],
    ids=["list", "bare-tensor", "float-key", "odd-leaf"],
)
def test_pickle_that_is_not_a_state_dict(tmp_path: Path, obj: Any, match: str) -> None:
    path = write_checkpoint(tmp_path / "notdict.pt", obj, {"0": b"\0" * 4})
    _expect_format_error(path, match)


def test_garbage_pickle(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "garbage.pt", None, {}, pickle_bytes=b"\x80\x02garbage")
    _expect_format_error(path, "malformed")


def test_malformed_tensor_arguments(tmp_path: Path) -> None:
    obj = {"w": FakeTensor("FloatStorage", "0", 1, 0, (1, -1), (1, 1))}
    path = write_checkpoint(tmp_path / "neg.pt", obj, {"0": b"\0" * 4})
    _expect_format_error(path, "non-negative")


# --------------------------------------------------------------------------
# Views that claim more memory than their storage (a tiny file must not exhaust memory).
# --------------------------------------------------------------------------

HUGE = (20000, 20000)  # 4e8 float32 elements: 1.6 GB as an array


def _stride0_bomb(path: Path, size: tuple[int, ...] = HUGE, value: float = 2.5) -> Path:
    """A few-hundred-byte checkpoint: one float storage, viewed as `size` with all strides 0."""
    obj = {"bomb": FakeTensor("FloatStorage", "0", 1, 0, size, (0,) * len(size))}
    return write_checkpoint(path, obj, {"0": np.array([value], np.float32).tobytes()})


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
    path = write_checkpoint(tmp_path / "b.pt", obj, {"0": storage.tobytes()})
    err = _expect_format_error(path, "'over'.*16 elements.*holds only 12")
    assert "'b'" not in str(err)
    loaded = load_torch_file(path, allow_expanding_views=True)
    assert_same_bits(loaded["b"], np.stack([storage[5:8]] * 2))
    assert loaded["b"].flags.owndata and loaded["b"].flags.writeable  # within the storage: an owned copy
    np.testing.assert_array_equal(loaded["over"], np.add.outer(np.arange(4), np.arange(4)).astype(np.float32))


def test_non_contiguous_views_load_exactly(tmp_path: Path) -> None:
    n = 5
    storage = np.arange(3 * n, dtype=np.float32)
    obj = {"t": FakeTensor("FloatStorage", "0", 3 * n, 0, (n, 3), (1, n)),  # a transposed [3, n]
           "every_other": FakeTensor("FloatStorage", "0", 3 * n, 1, (2, 2), (n, 2))}
    loaded = load_torch_file(write_checkpoint(tmp_path / "t.pt", obj, {"0": storage.tobytes()}))
    assert_same_bits(loaded["t"], storage.reshape(3, n).T)
    assert_same_bits(loaded["every_other"], storage.reshape(3, n)[:2, 1:5:2])
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
    path = write_checkpoint(tmp_path / "oob.pt", obj, {"0": b"\0" * 16})
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


@pytest.mark.torch
def test_torch_saved_stride0_view_is_refused_then_loaded_on_request(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch", reason="PyTorch not installed: optional torch.save oracle")
    path = tmp_path / "bomb.pt"
    torch.save({"bomb": torch.full((1,), 2.5).as_strided(HUGE, (0, 0)),
                "t": torch.arange(12.0).reshape(3, 4).t()}, path)
    assert path.stat().st_size < 4096
    _expect_format_error(path, "'bomb'.*size \\(20000, 20000\\), stride \\(0, 0\\).*allow_expanding_views")
    loaded = load_torch_file(path, allow_expanding_views=True)
    assert loaded["bomb"].shape == HUGE and loaded["bomb"].strides == (0, 0)
    assert loaded["bomb"][7, 19999] == np.float32(2.5)
    assert_same_bits(loaded["t"], np.arange(12.0, dtype=np.float32).reshape(3, 4).T)
