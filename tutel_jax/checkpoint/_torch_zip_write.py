"""Write PyTorch ``torch.save`` zip checkpoints without importing torch (see `torch_zip` for the layout):
uncompressed, 64-byte aligned records like torch's, written atomically (temporary file, fsync, rename), so
``torch.load(path, weights_only=True)`` reads them back as an ``OrderedDict[str, Tensor]``."""

from __future__ import annotations

import os
import pickle
import secrets
import struct
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from ._torch_zip_format import _ALIGNMENT, _ARCHIVE_VERSION, _SETITEMS_BATCH, _STORAGE_DTYPES

__all__ = ["save_torch_file"]


def _storage_name(dtype: np.dtype) -> str:
    """Map a numpy dtype to torch's typed storage class name, or raise TypeError."""
    if dtype == np.dtype(ml_dtypes.bfloat16):
        return "BFloat16Storage"
    for name, storage_dtype in _STORAGE_DTYPES.items():
        # Compare kind/size, so that explicitly byte-ordered dtypes ('>f4') match too.
        if storage_dtype.kind in "biuf" and (dtype.kind, dtype.itemsize) == (storage_dtype.kind, storage_dtype.itemsize):
            return name
    supported = "float32, float64, float16, bfloat16, int64, int32, int16, int8, uint8, bool"
    raise TypeError(f"unsupported dtype {dtype} for a torch checkpoint; supported: {supported}")


def _to_little_endian(array: np.ndarray) -> np.ndarray:
    """C-contiguous, little-endian copy-if-needed of ``array``, as torch stores it."""
    if array.dtype.kind in "iuf" and array.dtype.itemsize > 1:
        array = array.astype(array.dtype.newbyteorder("<"), copy=False)
    return np.asarray(array, order="C")


def _prepare_tensors(tensors: Mapping[str, Any]) -> list[tuple[str, np.ndarray, str]]:
    """Validate names and dtypes up front, so bad input never creates a file."""
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of str to arrays, got {type(tensors).__name__}")
    prepared = []
    for key, value in tensors.items():
        if not isinstance(key, str):
            raise TypeError(f"tensor names must be str, got {key!r}")
        array = np.asarray(value)  # jax.Array -> host numpy array
        storage = _storage_name(array.dtype)
        prepared.append((key, _to_little_endian(array), storage))
    return prepared


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-contiguous tensor, computed as torch does (max(size, 1))."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class _PickleWriter:
    """Emits the protocol-2 opcodes torch's own pickler produces for a state dict.

    Written by hand because the stdlib pickler insists on importing every
    global it writes, and torch is deliberately not imported here.
    """

    def __init__(self) -> None:
        self._parts: list[bytes] = [pickle.PROTO + bytes([2])]

    def emit(self, data: bytes) -> None:
        """Append raw opcodes."""
        self._parts.append(data)

    def global_(self, module: str, name: str) -> None:
        self.emit(pickle.GLOBAL + f"{module}\n{name}\n".encode("ascii"))

    def str_(self, text: str) -> None:
        data = text.encode("utf-8", errors="surrogatepass")
        self.emit(pickle.BINUNICODE + struct.pack("<I", len(data)) + data)

    def int_(self, value: int) -> None:
        # Let the stdlib choose BININT1/BININT2/BININT/LONG1; ints are never memoized.
        self.emit(pickle.dumps(value, protocol=2)[2:-1])

    def int_tuple(self, values: tuple[int, ...]) -> None:
        self.emit(pickle.MARK)
        for value in values:
            self.int_(value)
        self.emit(pickle.TUPLE)

    def empty_ordered_dict(self) -> None:
        """``OrderedDict()``, which torch pickles as the (empty) backward hooks."""
        self.global_("collections", "OrderedDict")
        self.emit(pickle.EMPTY_TUPLE + pickle.REDUCE)

    def tensor(self, storage_type: str, key: str, array: np.ndarray) -> None:
        """``_rebuild_tensor_v2(storage, 0, size, stride, False, OrderedDict())``."""
        self.global_("torch._utils", "_rebuild_tensor_v2")
        self.emit(pickle.MARK)
        # Persistent id ('storage', torch.<X>Storage, key, 'cpu', numel).
        self.emit(pickle.MARK)
        self.str_("storage")
        self.global_("torch", storage_type)
        self.str_(key)
        self.str_("cpu")
        self.int_(array.size)
        self.emit(pickle.TUPLE + pickle.BINPERSID)
        self.int_(0)  # storage offset
        self.int_tuple(array.shape)
        self.int_tuple(_contiguous_strides(array.shape))
        self.emit(pickle.NEWFALSE)  # requires_grad
        self.empty_ordered_dict()
        self.emit(pickle.TUPLE + pickle.REDUCE)

    def getvalue(self) -> bytes:
        return b"".join(self._parts) + pickle.STOP


def _state_dict_pickle(prepared: list[tuple[str, np.ndarray, str]]) -> bytes:
    """Pickle an ``OrderedDict`` of tensors; storage keys are '0', '1', ..."""
    writer = _PickleWriter()
    writer.empty_ordered_dict()
    for start in range(0, len(prepared), _SETITEMS_BATCH):
        writer.emit(pickle.MARK)
        for index, (name, array, storage) in enumerate(prepared[start : start + _SETITEMS_BATCH], start):
            writer.str_(name)
            writer.tensor(storage, str(index), array)
        writer.emit(pickle.SETITEMS)
    return writer.getvalue()


def _write_aligned(zf: zipfile.ZipFile, fh: Any, name: str, data: Any) -> None:
    """Write one uncompressed entry whose data starts on a 64-byte boundary.

    Like torch, pad the local header's extra field with an ``FB`` record full of
    'Z's; aligned records are what torch's ``mmap=True`` loading expects.
    """
    payload = memoryview(data).cast("B")
    zinfo = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    zinfo.compress_type = zipfile.ZIP_STORED
    zinfo.external_attr = 0o644 << 16
    zinfo.file_size = payload.nbytes
    zinfo.compress_size = zinfo.CRC = 0  # placeholders; zipfile fills them in after writing
    # Same rule zipfile applies when opening an entry for writing.
    zip64 = payload.nbytes * 1.05 > zipfile.ZIP64_LIMIT
    header_len = len(zinfo.FileHeader(zip64))
    padding = (-(fh.tell() + header_len + 4)) % _ALIGNMENT
    zinfo.extra = b"FB" + struct.pack("<H", padding) + b"Z" * padding
    with zf.open(zinfo, "w", force_zip64=zip64) as entry:
        entry.write(payload)


def _write_archive(fh: Any, prepared: list[tuple[str, np.ndarray, str]], top: str) -> None:
    """Write the zip layout of ``torch.save``, in torch's record order."""
    with zipfile.ZipFile(fh, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        _write_aligned(zf, fh, f"{top}/data.pkl", _state_dict_pickle(prepared))
        _write_aligned(zf, fh, f"{top}/.format_version", b"1")
        _write_aligned(zf, fh, f"{top}/.storage_alignment", str(_ALIGNMENT).encode("ascii"))
        _write_aligned(zf, fh, f"{top}/byteorder", b"little")
        for index, (_, array, _) in enumerate(prepared):
            # reshape(-1) makes 0-d arrays viewable as bytes; bool/bf16 views are plain bytes.
            _write_aligned(zf, fh, f"{top}/data/{index}", array.reshape(-1).view(np.uint8))
        _write_aligned(zf, fh, f"{top}/version", _ARCHIVE_VERSION)
        # torch writes a 40-digit id that is unique per save; its value is never checked.
        serialization_id = f"{secrets.randbelow(10**40):040d}".encode("ascii")
        _write_aligned(zf, fh, f"{top}/.data/serialization_id", serialization_id)


def _create_temp_file(target: Path) -> tuple[Path, int]:
    """Create an exclusive temp file next to ``target``.

    ``os.open`` with mode 0o666 lets the umask decide the permissions, so the
    final file gets the same mode a plain ``open(path, 'wb')`` would give it.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    while True:
        temp = target.with_name(f".{target.name}.{secrets.token_hex(8)}.tmp")
        try:
            return temp, os.open(temp, flags, 0o666)
        except FileExistsError:
            continue


def _fsync_directory(directory: Path) -> None:
    """Persist the rename itself; best effort, as not every OS can fsync a directory."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: Path, write: Callable[[Any], None]) -> None:
    """Run ``write(fh)`` on a temp file, fsync it, then rename it over ``path``.

    On any error the temp file is removed and an existing ``path`` is untouched.
    """
    temp, fd = _create_temp_file(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def _default_archive_name(path: Path) -> str:
    """torch names the top folder after the file stem (``model.pt`` -> ``model``)."""
    return path.stem or "archive"


def save_torch_file(
    path: str | os.PathLike[str],
    tensors: Mapping[str, Any],
    *,
    archive_name: str | None = None,
) -> None:
    """Write ``tensors`` as a ``torch.save`` zip checkpoint, without torch.

    ``torch.load(path, weights_only=True)`` returns an ``OrderedDict`` with the
    same names, dtypes, shapes and values. Each tensor gets its own contiguous
    storage. The file is written atomically: a temp file in the same directory
    is fsynced and renamed over ``path``.

    Args:
        path: destination file; its directory must exist.
        tensors: names to numpy arrays or ``jax.Array``s (converted with
            ``np.asarray``) of dtype float32, float64, float16, bfloat16, int64,
            int32, int16, int8, uint8 or bool; 0-d and empty arrays are fine.
        archive_name: the zip's top folder; defaults to the file stem, as torch.

    Raises:
        TypeError: a name is not a str, or a dtype is unsupported.
        ValueError: ``archive_name`` is not a plain folder name.
        OSError: the file cannot be written (``path`` is then unchanged).
    """
    target = Path(os.fspath(path))
    top = _default_archive_name(target) if archive_name is None else archive_name
    if not top or top in (".", "..") or "/" in top or "\\" in top:
        raise ValueError(f"archive_name must be a plain folder name, got {top!r}")
    prepared = _prepare_tensors(tensors)
    _atomic_write(target, lambda fh: _write_archive(fh, prepared, top))
