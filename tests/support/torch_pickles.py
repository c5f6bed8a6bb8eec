"""Hand-crafted `torch.save` archives for the checkpoint reader's tests: pickles written opcode by opcode
(`FakeTensor` pickles as torch's `_rebuild_tensor_v2`, `RawOps` splices opcodes verbatim), independent of the
writer under test."""

from __future__ import annotations

import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["FakeTensor", "RawOps", "assert_same_bits", "crafted_pickle", "encode", "global_op", "write_checkpoint",
           "write_zip"]

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


def global_op(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def encode(obj: Any) -> bytes:
    """Protocol-2 opcodes for ``obj`` (dicts become OrderedDict, like a state dict)."""
    if isinstance(obj, RawOps):
        return obj.data
    if isinstance(obj, FakeTensor):
        pid = (
            pickle.MARK
            + encode("storage")
            + global_op("torch", obj.storage_type)
            + encode(obj.key)
            + encode("cpu")
            + encode(obj.numel)
            + pickle.TUPLE
            + pickle.BINPERSID
        )
        hooks = global_op("collections", "OrderedDict") + pickle.EMPTY_TUPLE + pickle.REDUCE
        args = pid + encode(obj.offset) + encode(obj.size) + encode(obj.stride) + pickle.NEWFALSE + hooks
        tensor = global_op("torch._utils", "_rebuild_tensor_v2") + pickle.MARK + args + pickle.TUPLE + pickle.REDUCE
        if obj.as_parameter:
            return (
                global_op("torch._utils", "_rebuild_parameter")
                + pickle.MARK
                + tensor
                + pickle.NEWTRUE
                + hooks
                + pickle.TUPLE
                + pickle.REDUCE
            )
        return tensor
    if isinstance(obj, dict):
        body = b"".join(encode(k) + encode(v) for k, v in obj.items())
        return global_op("collections", "OrderedDict") + pickle.EMPTY_TUPLE + pickle.REDUCE + pickle.MARK + body + pickle.SETITEMS
    if isinstance(obj, list):
        return pickle.EMPTY_LIST + pickle.MARK + b"".join(map(encode, obj)) + pickle.APPENDS
    if isinstance(obj, tuple):
        return pickle.MARK + b"".join(map(encode, obj)) + pickle.TUPLE
    if isinstance(obj, str):
        data = obj.encode()
        return pickle.BINUNICODE + struct.pack("<I", len(data)) + data
    if isinstance(obj, (bool, int, float, type(None))):
        return pickle.dumps(obj, protocol=2)[2:-1]  # never memoized, so no BINPUT to strip
    raise TypeError(type(obj))


def crafted_pickle(obj: Any) -> bytes:
    return pickle.PROTO + b"\x02" + encode(obj) + pickle.STOP


def write_zip(path: Path, entries: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    return path


def write_checkpoint(
    path: Path,
    obj: Any,
    storages: dict[str, bytes],
    *,
    top: str = "archive",
    byteorder: bytes | None = b"little",
    pickle_bytes: bytes | None = None,
) -> Path:
    """A torch-layout archive with a crafted data.pkl and the given storages."""
    entries = {f"{top}/data.pkl": crafted_pickle(obj) if pickle_bytes is None else pickle_bytes}
    if byteorder is not None:
        entries[f"{top}/byteorder"] = byteorder
    entries.update({f"{top}/data/{key}": data for key, data in storages.items()})
    entries[f"{top}/version"] = b"3\n"
    return write_zip(path, entries)


def assert_same_bits(actual: np.ndarray, expected: np.ndarray) -> None:
    """Same dtype, shape and bits (bitwise, so NaNs and -0.0 count too)."""
    expected = np.asarray(expected)
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    assert actual.tobytes() == np.ascontiguousarray(expected).tobytes()
