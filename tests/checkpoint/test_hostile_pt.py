"""Hostile `torch.save` zip files: `load_torch_file` refuses, naming the zip entry, before the file can make it
allocate far more than it holds: deflate bombs (per entry and for the archive as a whole), storage entries of the
wrong size, pickles whose memo, stack or MARK nesting would be huge, and objects nested deeply or in a cycle.

Every file is built here, byte by byte (tiny, except the one 64 MiB-expanding deflate bomb, which is streamed);
memory is bounded with tracemalloc (NumPy and zipfile buffers are traced)."""

from __future__ import annotations

import pickle
import struct
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tutel_jax.checkpoint import _torch_zip as torch_zip
from tutel_jax.checkpoint import CheckpointFormatError, load_torch_file
from tutel_jax.checkpoint._torch_zip_format import MAX_EXPANSION_RATIO, MAX_NESTING, MAX_PICKLE_MARKS

MiB = 1 << 20


def _unicode(text: str) -> bytes:
    raw = text.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw


def _int(value: int) -> bytes:
    return pickle.BININT + struct.pack("<i", value)


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _tensor(key: str, numel: int) -> bytes:
    """Pickle ops pushing a float32 tensor [numel] over storage `key` (torch's _rebuild_tensor_v2 layout)."""
    pid = (pickle.MARK + _unicode("storage") + _global("torch", "FloatStorage") + _unicode(key) + _unicode("cpu")
           + _int(numel) + pickle.TUPLE + pickle.BINPERSID)
    return (_global("torch._utils", "_rebuild_tensor_v2") + pickle.MARK + pid + _int(0)
            + pickle.MARK + _int(numel) + pickle.TUPLE + pickle.MARK + _int(1) + pickle.TUPLE
            + pickle.NEWFALSE + pickle.NONE + pickle.TUPLE + pickle.REDUCE)


def _state_dict(items: dict[str, bytes]) -> bytes:
    """A protocol-2 pickle of {name: the object the ops push}."""
    body = b"".join(_unicode(name) + ops + pickle.SETITEM for name, ops in items.items())
    return pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + body + pickle.STOP


def _write(path: Path, pkl: bytes, storages: dict[str, bytes | int] | None = None,
           deflate: bool = False) -> Path:
    """A torch.save-style zip: archive/data.pkl and archive/data/<key> entries; an int storage is that many zero
    bytes, streamed (so that the test itself never holds them)."""
    method = zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
    with zipfile.ZipFile(path, "w", compression=method) as zf:
        zf.writestr("archive/data.pkl", pkl)
        zf.writestr("archive/byteorder", b"little")
        for key, data in (storages or {}).items():
            if isinstance(data, bytes):
                zf.writestr(f"archive/data/{key}", data)
                continue
            info = zipfile.ZipInfo(f"archive/data/{key}")
            info.compress_type = method
            with zf.open(info, "w", force_zip64=True) as fh:
                chunk = bytes(MiB)
                for start in range(0, data, MiB):
                    fh.write(chunk[:min(MiB, data - start)])
    return path


def _refused(path: Path, entry: str, match: str, peak_limit: int = 16 * MiB) -> str:
    """Loads `path` under tracemalloc: a CheckpointFormatError naming the file, `entry` and `match`, with the
    traced peak below `peak_limit`. Returns the message."""
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointFormatError) as info:
            load_torch_file(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert type(info.value) is CheckpointFormatError
    assert str(path) in message and f"entry {entry!r}" in message, message
    assert match in message, message
    assert peak < peak_limit, f"peak {peak} bytes while refusing"
    return message


def test_well_formed_crafted_file_loads(tmp_path: Path) -> None:
    """The builders above make a readable file (so that each refusal below is about its one defect)."""
    values = np.arange(4, dtype=np.float32)
    path = _write(tmp_path / "ok.pt", _state_dict({"w": _tensor("0", 4)}), {"0": values.tobytes()}, deflate=True)
    np.testing.assert_array_equal(load_torch_file(path)["w"], values)


def test_deflate_bomb_is_refused_without_inflating(tmp_path: Path) -> None:
    size = 64 * MiB  # zeros: deflate packs them ~1000x
    path = _write(tmp_path / "bomb.pt", _state_dict({"w": _tensor("0", size // 4)}), {"0": size}, deflate=True)
    assert path.stat().st_size * MAX_EXPANSION_RATIO < size
    _refused(path, "archive/data/0", "decompression bomb", peak_limit=4 * MiB)


def test_many_small_bombs_hit_the_archive_budget(tmp_path: Path) -> None:
    """Each entry is at the always-accepted size, but all of them together expand past the archive's budget."""
    n = 6
    pkl = _state_dict({f"w{i}": _tensor(str(i), MiB // 4) for i in range(n)})
    path = _write(tmp_path / "bombs.pt", pkl, {str(i): MiB for i in range(n)}, deflate=True)
    assert path.stat().st_size * MAX_EXPANSION_RATIO + MiB < n * MiB
    message = _refused(path, "archive/data/1", f"{MAX_EXPANSION_RATIO}x the file's size")
    assert "archive/data/0" not in message


@pytest.mark.parametrize("stored", [2, 8], ids=["short", "long"])
def test_storage_entry_of_the_wrong_size(tmp_path: Path, stored: int) -> None:
    path = _write(tmp_path / "size.pt", _state_dict({"w": _tensor("0", 1)}), {"0": bytes(stored)})
    _refused(path, "archive/data/0", f"has {stored} bytes, expected 4 bytes")


@pytest.mark.parametrize("index", [1 << 26, (1 << 32) - 1], ids=["512MiB-memo", "max-index"])
def test_memo_index_far_past_the_memo_is_refused(tmp_path: Path, index: int) -> None:
    """LONG_BINPUT 2**26 would make the C unpickler grow its memo to 2**27 slots (1 GiB) before anything else."""
    pkl = pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + pickle.LONG_BINPUT + struct.pack("<I", index) + pickle.STOP
    _refused(_write(tmp_path / "memo.pt", pkl), "archive/data.pkl", f"memo index {index}")


def test_text_put_index_is_bounded_too(tmp_path: Path) -> None:
    pkl = pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + pickle.PUT + b"99999999999\n" + pickle.STOP
    _refused(_write(tmp_path / "put.pt", pkl), "archive/data.pkl", "memo index 99999999999")


def test_pickle_stack_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stack bound (1M items by default) with a small limit, so that the file stays tiny."""
    monkeypatch.setattr(torch_zip, "MAX_PICKLE_STACK", 100)
    pkl = pickle.PROTO + b"\x02" + pickle.NONE * 101 + pickle.STOP
    _refused(_write(tmp_path / "stack.pt", pkl), "archive/data.pkl", "more than 100 items")


def test_mark_nesting_is_bounded(tmp_path: Path) -> None:
    pkl = pickle.PROTO + b"\x02" + pickle.MARK * (MAX_PICKLE_MARKS + 1) + pickle.STOP
    _refused(_write(tmp_path / "marks.pt", pkl), "archive/data.pkl", f"deeper than {MAX_PICKLE_MARKS}")


def _nested_tuples(depth: int) -> bytes:
    return pickle.EMPTY_TUPLE + pickle.TUPLE1 * depth


def _self_containing_list() -> bytes:
    return pickle.EMPTY_LIST + pickle.BINPUT + b"\x00" + pickle.BINGET + b"\x00" + pickle.APPEND


@pytest.mark.parametrize("ops", [_nested_tuples(100_000), _nested_tuples(MAX_NESTING + 2), _self_containing_list()],
                         ids=["100k-deep", "just-too-deep", "cycle"])
def test_deep_or_cyclic_objects_are_refused(tmp_path: Path, ops: bytes) -> None:
    path = _write(tmp_path / "deep.pt", _state_dict({"w": ops}))
    _refused(path, "archive/data.pkl", f"deeper than {MAX_NESTING} levels")


def test_nesting_at_the_limit_loads(tmp_path: Path) -> None:
    """Nesting up to the bound is accepted (empty tuples carry no leaves)."""
    path = _write(tmp_path / "ok.pt", _state_dict({"w": _nested_tuples(MAX_NESTING - 1)}))
    assert load_torch_file(path) == {}


@pytest.mark.parametrize("pkl, match", [
    (pickle.PROTO + b"\x02" + b"\xff" + pickle.STOP, "malformed pickle"),
    (pickle.PROTO + b"\x02" + pickle.BINUNICODE + struct.pack("<I", 1 << 30) + b"x", "malformed pickle"),
    (pickle.PROTO + b"\x02" + pickle.TUPLE + pickle.STOP, "has no MARK"),
    (pickle.PROTO + b"\x02" + pickle.APPEND + pickle.STOP, "stack underflow"),
], ids=["unknown-opcode", "string-past-the-end", "tuple-without-mark", "underflow"])
def test_malformed_pickles_name_the_entry(tmp_path: Path, pkl: bytes, match: str) -> None:
    _refused(_write(tmp_path / "bad.pt", pkl), "archive/data.pkl", match)


def test_oversized_pickle_entry_is_refused_before_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_zip, "MAX_PICKLE_BYTES", 64)
    pkl = _state_dict({"w": _nested_tuples(100)})
    _refused(_write(tmp_path / "big.pt", pkl), "archive/data.pkl", "over the 64-byte limit")
