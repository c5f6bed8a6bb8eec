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

The file is untrusted input, so what it can make the reader allocate is bounded
(limits in ``torch_zip_format``): every zip entry is read in chunks within its
declared size, a compressed entry may expand at most ``MAX_EXPANSION_RATIO``
times (checked from the zip directory before it is inflated; the archive as a
whole likewise), a storage entry must hold exactly the bytes its persistent id
declares, and ``data.pkl`` is scanned opcode by opcode before it is unpickled:
memo indices, stack size and MARK nesting are bounded, so that a crafted
pickle cannot ask for a huge memo or stack. The unpickled object may nest at
most ``MAX_NESTING`` levels (cycles included). Errors name the zip entry.
:func:`save_torch_file` writes the same layout (uncompressed, 64-byte aligned
records, like torch) so that ``torch.load(path, weights_only=True)`` reads it
back as an ``OrderedDict[str, Tensor]``.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import pickletools
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


from ._torch_zip_format import (_STORAGE_DTYPES, EXPANSION_FLOOR_BYTES, MAX_EXPANSION_RATIO, MAX_NESTING,
                               MAX_PICKLE_BYTES, MAX_PICKLE_MARKS, MAX_PICKLE_STACK)


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


def _flatten(obj: Any, prefix: str, out: dict[str, Any], depth: int = 0) -> None:
    """Flatten nested dicts/lists into ``out`` with '.'-joined keys.

    Leaves kept: tensors, and ints/floats/bools (as 0-d arrays). ``None``,
    strings and bytes are skipped: they carry no weights. Nesting deeper than
    ``MAX_NESTING`` (a cyclic container, too, which pickle can build) is
    refused instead of recursing without bound.
    """
    if depth > MAX_NESTING and isinstance(obj, (dict, list, tuple)):
        raise _FormatProblem(f"data.pkl nests containers deeper than {MAX_NESTING} levels (or in a cycle) "
                             f"under {prefix[:200]!r}")
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
        _flatten(value, f"{prefix}.{key}" if prefix else str(key), out, depth + 1)


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


def _check_byteorder(reader: _EntryReader, top: str) -> None:
    """Refuse big-endian archives (only written by torch on big-endian hosts)."""
    try:
        raw = reader.read(f"{top}/byteorder", max_bytes=16)
    except KeyError:
        return  # torch < 1.12 wrote no byteorder record; those files are little-endian
    order = raw.decode("ascii", errors="replace").strip()
    if order == "big":
        raise _FormatProblem("checkpoint was written big-endian (byteorder 'big'); only little-endian is supported")
    if order != "little":
        raise _FormatProblem(f"unknown byteorder record {order!r}")


def _storage_array(reader: _EntryReader, top: str, ref: _StorageRef) -> np.ndarray:
    """Read one storage's bytes as a flat array of its dtype (its entry must hold exactly numel elements)."""
    name = f"{top}/data/{ref.key}"
    itemsize = ref.dtype.itemsize
    try:
        raw = reader.read(name, exact=ref.numel * itemsize,
                          what=f"{ref.numel} x {itemsize}-byte {ref.dtype} elements")
    except KeyError:
        raise _FormatProblem(f"storage {ref.key!r} is referenced by data.pkl but entry {name!r} is missing") from None
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


def _materialize_all(reader: _EntryReader, top: str, leaves: dict[str, Any],
                     allow_expanding_views: bool = False) -> dict[str, np.ndarray]:
    """Turn tensor records into arrays, reading each storage once and then dropping it."""
    by_storage: dict[str, list[str]] = collections.defaultdict(list)
    for key, leaf in leaves.items():
        if isinstance(leaf, _TensorRecord):
            by_storage[leaf.storage.key].append(key)
    arrays: dict[str, np.ndarray] = {}
    for keys in by_storage.values():
        flat = _storage_array(reader, top, leaves[keys[0]].storage)
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
    reader = _EntryReader(zf, os.path.getsize(path))
    _check_byteorder(reader, top)
    entry = f"{top}/data.pkl"
    data = reader.read(entry, max_bytes=MAX_PICKLE_BYTES)
    leaves: dict[str, Any] = {}
    try:
        _scan_pickle(data)  # bounds memo, stack and marks before the C unpickler sizes anything
        try:
            obj = _RestrictedUnpickler(io.BytesIO(data), path).load()
        except RecursionError:
            raise _FormatProblem("pickle nests too deeply") from None
        del data
        if not isinstance(obj, dict):
            raise _FormatProblem(f"data.pkl holds a {type(obj).__name__}, expected a dict of tensors (a state dict)")
        _flatten(obj, "", leaves)
    except UnsafeCheckpointError:
        raise
    except (_FormatProblem, *_PICKLE_ERRORS) as e:  # name the entry the problem is in
        detail = str(e) if isinstance(e, _FormatProblem) else f"{type(e).__name__}: {e}"
        raise _FormatProblem(f"entry {entry!r}: {detail}") from e
    return _materialize_all(reader, top, leaves, allow_expanding_views)


class _EntryReader:
    """Reads zip entries within bounds: each no larger than its declared size (and than the caller's limit),
    a compressed one expanding at most MAX_EXPANSION_RATIO times its compressed size, and all of them together
    at most MAX_EXPANSION_RATIO times the archive (plus EXPANSION_FLOOR_BYTES). The sizes are checked from the
    zip directory before an entry is inflated, and entries are inflated in chunks into one buffer of the
    declared size (zipfile never returns more than that; a short or corrupt stream is an error)."""

    _CHUNK = 1 << 20

    def __init__(self, zf: zipfile.ZipFile, archive_bytes: int) -> None:
        self._zf = zf
        self._budget = MAX_EXPANSION_RATIO * archive_bytes + EXPANSION_FLOOR_BYTES

    def read(self, name: str, *, max_bytes: int | None = None, exact: int | None = None,
             what: str = "") -> bytearray:
        """The bytes of entry `name` (KeyError when there is none). `max_bytes`: the most it may hold;
        `exact`: the size it must have (`what` describes it for the error)."""
        info = self._zf.getinfo(name)
        size = info.file_size
        if exact is not None and size != exact:
            raise _FormatProblem(f"storage entry {name!r} has {size} bytes, expected {exact} bytes ({what})")
        if max_bytes is not None and size > max_bytes:
            raise _FormatProblem(f"entry {name!r} declares {size} bytes, over the {max_bytes}-byte limit")
        if (info.compress_type != zipfile.ZIP_STORED and size > EXPANSION_FLOOR_BYTES
                and size > MAX_EXPANSION_RATIO * info.compress_size):
            raise _FormatProblem(f"entry {name!r} would expand {info.compress_size} compressed bytes to {size} "
                                 f"(over {MAX_EXPANSION_RATIO}x: a decompression bomb?); refused before inflating")
        if size > self._budget:
            raise _FormatProblem(f"entry {name!r}: {size} bytes would take the archive's entries past "
                                 f"{MAX_EXPANSION_RATIO}x the file's size; refused before inflating")
        self._budget -= size
        out = bytearray(size)
        view, done = memoryview(out), 0
        with self._zf.open(info) as fh:
            while done < size:
                got = fh.readinto(view[done:done + self._CHUNK])
                if not got:
                    raise _FormatProblem(f"entry {name!r} ends after {done} of its {size} declared bytes")
                done += got
        return out


def _scan_pickle(data: bytes | bytearray) -> None:
    """Walks the opcodes of the pickle `data` (nothing is built or run) and refuses what
    could make the C unpickler allocate far more than the file holds: a memo index past the number of memo
    entries stored so far (picklers number them 0, 1, 2, ...; the unpickler sizes its memo by the largest
    index), a stack of more than MAX_PICKLE_STACK items, MARKs nested deeper than MAX_PICKLE_MARKS."""
    stack, marks, memo = 0, [], 0
    try:
        for opcode, arg, pos in pickletools.genops(io.BytesIO(bytes(data))):
            if opcode.name in ("PUT", "BINPUT", "LONG_BINPUT"):
                if not (isinstance(arg, int) and 0 <= arg <= memo):
                    raise _FormatProblem(f"pickle memo index {arg!r:.40} at byte {pos} skips past "
                                         f"the {memo} entries stored so far (a memo sized by it would be huge)")
                memo += arg == memo
            elif opcode.name == "MEMOIZE":
                memo += 1
            before, after = opcode.stack_before, opcode.stack_after
            if opcode.name == "POP" and marks and marks[-1] == stack:
                marks.pop()  # POP of a MARK (protocol 0 recursive tuples)
                continue
            if pickletools.markobject in before:
                if not marks:
                    raise _FormatProblem(f"pickle opcode {opcode.name} at byte {pos} has no MARK")
                stack = marks.pop() - before.index(pickletools.markobject)
            else:
                stack -= len(before)
            if stack < 0:
                raise _FormatProblem(f"pickle stack underflow at byte {pos} ({opcode.name})")
            if pickletools.markobject in after:
                marks.append(stack)
                if len(marks) > MAX_PICKLE_MARKS:
                    raise _FormatProblem(f"pickle MARKs nest deeper than {MAX_PICKLE_MARKS} "
                                         f"at byte {pos}")
            else:
                stack += len(after)
            if stack > MAX_PICKLE_STACK:
                raise _FormatProblem(f"pickle stack holds more than {MAX_PICKLE_STACK} items "
                                     f"at byte {pos}")
    except ValueError as e:  # pickletools' own errors: unknown opcode, truncated argument
        raise _FormatProblem(f"malformed pickle ({e})") from None


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


# Exceptions the unpickler raises on a malformed pickle, reported with the entry's name (UnsafeCheckpointError, a
# ValueError, is re-raised as it is).
_PICKLE_ERRORS = (pickle.UnpicklingError, EOFError, KeyError, IndexError, TypeError, AttributeError,
                  OverflowError, UnicodeDecodeError, struct.error, ValueError, RecursionError)

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


from ._torch_zip_write import save_torch_file  # noqa: E402  (the writer shares this module's tables)
