"""Read and write PyTorch ``torch.save`` zip checkpoints without importing torch.

Since torch 1.6, ``torch.save`` writes a zip archive whose entries all live
under one top folder (the file stem, e.g. ``state_dict/``):

* ``<top>/data.pkl`` -- a pickle of the saved object. Tensors are pickled as
  ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`` and
  every storage is a *persistent id*
  ``('storage', torch.FloatStorage, key, location, numel)``;
* ``<top>/data/<key>`` -- the raw little-endian bytes of each storage;
* ``<top>/byteorder``, ``<top>/version`` and a few bookkeeping records.

:func:`load_torch_file` unpickles ``data.pkl`` with a restricted unpickler that
only resolves the handful of globals a state dict needs, so no code from the
file is ever executed, and returns a flat ``dict[str, np.ndarray]``.
:func:`save_torch_file` writes the same layout (uncompressed, 64-byte aligned
records, like torch) so that ``torch.load(path, weights_only=True)`` reads it
back as an ``OrderedDict[str, Tensor]``.
"""

from __future__ import annotations

import collections
import os
import pickle
import struct
import sys
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "CheckpointFormatError",
    "UnsafeCheckpointError",
    "load_torch_file",
    "save_torch_file",
]


class CheckpointFormatError(ValueError):
    """The file is not a readable checkpoint: a malformed ``torch.save`` zip here; a safetensors tensor with
    non-finite values (``safetensors_io.NonFiniteTensorError``, a subclass)."""


class UnsafeCheckpointError(ValueError):
    """The checkpoint's pickle references a global outside the allow-list."""


from .torch_zip_format import _STORAGE_DTYPES


class _FormatProblem(Exception):
    """Internal: a format problem found before the file path is attached."""


# --------------------------------------------------------------------------
# Reader
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _StorageType:
    """Stand-in returned by ``find_class`` for ``torch.<X>Storage`` globals."""

    name: str
    dtype: np.dtype | None  # None: a torch storage type whose dtype is unsupported


@dataclass(frozen=True)
class _StorageRef:
    """A storage named by a persistent id; its bytes are read lazily."""

    key: str
    dtype: np.dtype
    numel: int


@dataclass(frozen=True)
class _TensorRecord:
    """A tensor view on a storage, as passed to ``_rebuild_tensor_v2``."""

    storage: _StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _int_tuple(value: Any, what: str) -> tuple[int, ...]:
    """Validate a pickled ``size``/``stride`` tuple of non-negative ints."""
    if not isinstance(value, (tuple, list)):
        raise _FormatProblem(f"tensor {what} is {type(value).__name__}, expected a tuple")
    for item in value:
        # bool is an int subclass but never a valid size; reject it explicitly.
        if not isinstance(item, int) or isinstance(item, bool) or item < 0:
            raise _FormatProblem(f"tensor {what} {value!r} is not a tuple of non-negative ints")
    return tuple(value)


def _rebuild_tensor_v2(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> _TensorRecord:
    """Safe replacement for ``torch._utils._rebuild_tensor_v2``.

    Records the view; gradients, hooks and metadata are irrelevant to weights.
    """
    del requires_grad, backward_hooks, metadata
    if not isinstance(storage, _StorageRef):
        raise _FormatProblem(f"tensor storage is {type(storage).__name__}, expected a persistent storage id")
    if not isinstance(storage_offset, int) or isinstance(storage_offset, bool) or storage_offset < 0:
        raise _FormatProblem(f"tensor storage offset {storage_offset!r} is not a non-negative int")
    size_t = _int_tuple(size, "size")
    stride_t = _int_tuple(stride, "stride")
    if len(size_t) != len(stride_t):
        raise _FormatProblem(f"tensor size {size_t} and stride {stride_t} have different ranks")
    return _TensorRecord(storage, storage_offset, size_t, stride_t)


def _rebuild_parameter(data: Any, requires_grad: Any = False, backward_hooks: Any = None) -> _TensorRecord:
    """Safe replacement for ``torch._utils._rebuild_parameter``: a Parameter is its data."""
    del requires_grad, backward_hooks
    if not isinstance(data, _TensorRecord):
        raise _FormatProblem(f"parameter data is {type(data).__name__}, expected a tensor")
    return data


def _allowed_globals() -> dict[tuple[str, str], Any]:
    """The only globals a state-dict pickle may reference, mapped to safe stand-ins."""
    allowed: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    }
    for name, dtype in _STORAGE_DTYPES.items():
        allowed[("torch", name)] = _StorageType(name, dtype)
    return allowed


_ALLOWED_GLOBALS = _allowed_globals()


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that resolves only allow-listed globals and never runs file code.

    Every way a pickle can reach a callable (GLOBAL, STACK_GLOBAL, INST, OBJ,
    EXT*) goes through ``find_class``, so refusing there is sufficient.
    """

    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            pass
        if module == "torch" and name.endswith("Storage") and name.isidentifier():
            # An inert marker, never the real class: lets persistent_load report
            # an unsupported dtype (e.g. ComplexFloatStorage) as a format error.
            return _StorageType(name, None)
        raise UnsafeCheckpointError(
            f"{self._path}: refusing to load global '{module}.{name}' from the checkpoint pickle; "
            "only tensors, storages and OrderedDict are allowed"
        )

    def persistent_load(self, pid: Any) -> _StorageRef:
        if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage":
            raise _FormatProblem(f"unsupported persistent id {pid!r:.200}")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise _FormatProblem(f"persistent id names {storage_type!r:.100} instead of a storage type")
        if storage_type.dtype is None:
            supported = ", ".join(f"torch.{name}" for name in _STORAGE_DTYPES)
            raise _FormatProblem(f"unsupported dtype storage 'torch.{storage_type.name}'; supported: {supported}")
        if not isinstance(key, str) or not isinstance(numel, int) or numel < 0:
            raise _FormatProblem(f"malformed storage persistent id {pid!r:.200}")
        return _StorageRef(key, storage_type.dtype, numel)


def _flatten(obj: Any, prefix: str, out: dict[str, Any]) -> None:
    """Flatten nested dicts/lists into ``out`` with '.'-joined keys.

    Leaves kept: tensors, and ints/floats/bools (as 0-d arrays). ``None``,
    strings and bytes are skipped: they carry no weights.
    """
    if isinstance(obj, dict):
        # dict.items, not obj.items: an unpickled BUILD may shadow attributes.
        items: Iterator[tuple[Any, Any]] = iter(dict.items(obj))
    elif isinstance(obj, (list, tuple)):
        items = iter(enumerate(obj))
    else:
        _add_leaf(obj, prefix, out)
        return
    for key, value in items:
        # int keys occur in optimizer state ({0: {...}}); torch module names are str.
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise _FormatProblem(f"key {key!r:.100} under {prefix or '<top level>'!r} is not a string")
        _flatten(value, f"{prefix}.{key}" if prefix else str(key), out)


def _add_leaf(value: Any, key: str, out: dict[str, Any]) -> None:
    """Store one leaf value under ``key`` (see :func:`_flatten`)."""
    if value is None or isinstance(value, (str, bytes)):
        return
    if isinstance(value, _TensorRecord):
        leaf: Any = value
    elif isinstance(value, bool):
        leaf = np.asarray(value, dtype=np.bool_)
    elif isinstance(value, int):
        leaf = np.asarray(value, dtype=np.int64)
    elif isinstance(value, float):
        leaf = np.asarray(value, dtype=np.float64)
    else:
        raise _FormatProblem(f"unsupported value of type {type(value).__name__} at key {key!r}")
    if key in out:
        raise _FormatProblem(f"key {key!r} occurs twice after flattening nested mappings")
    out[key] = leaf


def _find_top_folder(zf: zipfile.ZipFile) -> str:
    """Return the archive's top folder: the one holding ``data.pkl``."""
    tops = sorted({name.split("/", 1)[0] for name in zf.namelist() if name.count("/") == 1 and name.endswith("/data.pkl")})
    if not tops:
        raise _FormatProblem("zip archive has no '<top>/data.pkl' entry; not a torch.save checkpoint")
    if len(tops) > 1:
        raise _FormatProblem(f"zip archive has several data.pkl entries under {tops}")
    return tops[0]


def _check_byteorder(zf: zipfile.ZipFile, top: str) -> None:
    """Refuse big-endian archives (only written by torch on big-endian hosts)."""
    try:
        raw = zf.read(f"{top}/byteorder")
    except KeyError:
        return  # torch < 1.12 wrote no byteorder record; those files are little-endian
    order = raw.decode("ascii", errors="replace").strip()
    if order == "big":
        raise _FormatProblem("checkpoint was written big-endian (byteorder 'big'); only little-endian is supported")
    if order != "little":
        raise _FormatProblem(f"unknown byteorder record {order!r}")


def _storage_array(zf: zipfile.ZipFile, top: str, ref: _StorageRef) -> np.ndarray:
    """Read one storage's bytes as a flat read-only array of its dtype."""
    name = f"{top}/data/{ref.key}"
    try:
        raw = zf.read(name)
    except KeyError:
        raise _FormatProblem(f"storage {ref.key!r} is referenced by data.pkl but entry {name!r} is missing") from None
    itemsize = ref.dtype.itemsize
    if len(raw) % itemsize or len(raw) < ref.numel * itemsize:
        raise _FormatProblem(
            f"storage entry {name!r} has {len(raw)} bytes, expected {ref.numel} x {itemsize}-byte {ref.dtype} elements"
        )
    if ref.dtype == np.bool_:
        # torch writes 0/1 bytes; normalise anything else instead of making odd bools.
        return np.frombuffer(raw, dtype=np.uint8) != 0
    flat = np.frombuffer(raw, dtype=ref.dtype)
    if sys.byteorder != "little" and itemsize > 1:
        flat = flat.byteswap()
    return flat


def _materialize(flat: np.ndarray, record: _TensorRecord, key: str, allow_expanding_views: bool = False) -> np.ndarray:
    """Build the array for ``record`` from its storage (torch's view semantics).

    Every view must lie inside its storage. A view with more elements than its storage (a broadcast or
    overlapping view, e.g. stride 0) is refused unless ``allow_expanding_views``; then it is returned as a
    read-only strided view of the storage (no copy). Any other view is copied into an owned C-contiguous array,
    which never needs more memory than the storage itself.
    """
    dtype = record.storage.dtype
    where = f"tensor {key!r} (offset {record.offset}, size {record.size}, stride {record.stride})"
    if record.offset > flat.size:
        raise _FormatProblem(f"{where} starts past the end of storage {record.storage.key!r}, "
                             f"which holds only {flat.size} elements")
    if 0 in record.size:
        return np.empty(record.size, dtype=dtype)
    last = record.offset + sum((n - 1) * s for n, s in zip(record.size, record.stride, strict=True))
    if last >= flat.size:
        raise _FormatProblem(
            f"{where} reads element {last} but storage {record.storage.key!r} holds only {flat.size}"
        )
    count = 1
    for n in record.size:
        count *= n
    if count > flat.size and not allow_expanding_views:
        raise _FormatProblem(
            f"{where} has {count} elements ({count * flat.itemsize} bytes as an array) but storage "
            f"{record.storage.key!r} holds only {flat.size}: a broadcast/overlapping (e.g. stride-0) view is "
            "refused, as it would make a small file allocate far more memory than it holds; pass "
            "allow_expanding_views=True to load_torch_file to get it as a read-only view of the storage"
        )
    view = np.lib.stride_tricks.as_strided(
        flat[record.offset :],
        shape=record.size,
        strides=tuple(s * flat.itemsize for s in record.stride),
        writeable=False,
    )
    if count > flat.size:
        return view  # allowed expanding view: read-only, shares the storage's memory
    # A fresh C-contiguous copy: owned, writable and independent of the zip bytes.
    return np.array(view, dtype=dtype, order="C", copy=True)


def _materialize_all(zf: zipfile.ZipFile, top: str, leaves: dict[str, Any],
                     allow_expanding_views: bool = False) -> dict[str, np.ndarray]:
    """Turn tensor records into arrays, reading each storage once and then dropping it."""
    by_storage: dict[str, list[str]] = collections.defaultdict(list)
    for key, leaf in leaves.items():
        if isinstance(leaf, _TensorRecord):
            by_storage[leaf.storage.key].append(key)
    arrays: dict[str, np.ndarray] = {}
    for keys in by_storage.values():
        flat = _storage_array(zf, top, leaves[keys[0]].storage)
        for key in keys:
            record = leaves[key]
            if record.storage.dtype != leaves[keys[0]].storage.dtype:
                raise _FormatProblem(f"storage {record.storage.key!r} is used with two dtypes")
            arrays[key] = _materialize(flat, record, key, allow_expanding_views)
        del flat  # bound peak memory to one storage's bytes at a time
    # Preserve the checkpoint's key order.
    return {key: arrays[key] if isinstance(leaf, _TensorRecord) else leaf for key, leaf in leaves.items()}


def _read_checkpoint(zf: zipfile.ZipFile, path: str, allow_expanding_views: bool = False) -> dict[str, np.ndarray]:
    """Unpickle ``data.pkl`` safely and materialise every tensor."""
    top = _find_top_folder(zf)
    _check_byteorder(zf, top)
    with zf.open(f"{top}/data.pkl") as pkl:
        obj = _RestrictedUnpickler(pkl, path).load()
    if not isinstance(obj, dict):
        raise _FormatProblem(f"data.pkl holds a {type(obj).__name__}, expected a dict of tensors (a state dict)")
    leaves: dict[str, Any] = {}
    _flatten(obj, "", leaves)
    return _materialize_all(zf, top, leaves, allow_expanding_views)


def _describe_non_zip(path: str) -> str:
    """Explain why a file that is not a zip archive cannot be read."""
    with open(path, "rb") as fh:
        head = fh.read(4)
    if not head:
        return "file is empty"
    if head == b"PK\x03\x04":
        return "zip archive is truncated or corrupt (its central directory is missing)"
    if head[:1] == b"\x80":
        # The legacy (torch < 1.6 or _use_new_zipfile_serialization=False)
        # format starts with a pickled magic number.
        return "not a zip archive; looks like the legacy non-zip torch.save format, which is not supported"
    return "not a zip archive (torch.save writes zip archives); the file may be truncated or corrupt"


# Exceptions the stdlib raises on malformed input; all become CheckpointFormatError.
_MALFORMED_INPUT_ERRORS = (
    _FormatProblem,
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    pickle.UnpicklingError,
    zlib.error,
    struct.error,
    EOFError,
    KeyError,
    IndexError,
    TypeError,
    AttributeError,
    ValueError,
    OverflowError,
    UnicodeDecodeError,
    RecursionError,
    NotImplementedError,
)


def load_torch_file(path: str | os.PathLike[str], *, allow_expanding_views: bool = False) -> dict[str, np.ndarray]:
    """Load a ``torch.save`` zip checkpoint of tensors as numpy arrays, without torch.

    Args:
        path: a file written by ``torch.save`` (torch >= 1.6 zip format), or by
            :func:`save_torch_file`.
        allow_expanding_views: accept tensors that are views with more elements
            than their storage holds (broadcast/overlapping views such as
            ``x.expand(...)``, stride 0). Off by default: such a view lets a tiny
            file claim gigabytes (a ``(20000, 20000)`` stride-``(0, 0)`` view of
            one float is 1.6 GB as an array). When on, each such tensor is
            returned WITHOUT copying, as a read-only ``as_strided`` view of its
            storage (not owned, not C-contiguous; ``np.array(a)`` copies it).

    Returns:
        A dict in the checkpoint's key order mapping names to owned, C-contiguous
        numpy arrays with torch's dtype (bfloat16 as ``ml_dtypes.bfloat16``;
        views are copied, except the expanding views above);
        0-d tensors become 0-d arrays. Nested dicts (e.g. ``{"model": {...}}``)
        and lists are flattened with '.'-joined keys (``"model.fc.weight"``,
        ``"layers.0.w"``). Non-tensor leaves: ints, floats and bools become 0-d
        int64/float64/bool arrays; ``None``, strings and bytes are skipped.

    Raises:
        UnsafeCheckpointError: the pickle references any global other than
            ``collections.OrderedDict``, ``torch._utils._rebuild_tensor_v2``,
            ``torch._utils._rebuild_parameter`` or a ``torch.<X>Storage`` type.
        CheckpointFormatError: the file is missing or unreadable, not a zip,
            truncated or otherwise malformed, uses an unsupported dtype (e.g.
            ``torch.ComplexFloatStorage``) or byte order, or does not hold a
            dict; a tensor view reaches outside its storage (offset or last
            element past its end), or has more elements than its storage
            without ``allow_expanding_views`` (the message names the tensor,
            its size/stride and the storage size). The message names the file.
    """
    path_str = os.fspath(path)
    if not os.path.isfile(path_str):
        raise CheckpointFormatError(f"{path_str}: checkpoint file does not exist (or is not a regular file)")
    try:
        if not zipfile.is_zipfile(path_str):
            raise _FormatProblem(_describe_non_zip(path_str))
        with zipfile.ZipFile(path_str) as zf:
            return _read_checkpoint(zf, path_str, allow_expanding_views)
    except (UnsafeCheckpointError, CheckpointFormatError):
        raise
    except OSError as exc:
        raise CheckpointFormatError(f"{path_str}: cannot read checkpoint: {exc}") from exc
    except _MALFORMED_INPUT_ERRORS as exc:
        detail = str(exc) if isinstance(exc, _FormatProblem) else f"{type(exc).__name__}: {exc}"
        raise CheckpointFormatError(f"{path_str}: malformed torch checkpoint: {detail}") from exc


from .torch_zip_write import save_torch_file  # noqa: E402  (the writer shares this module's tables)
