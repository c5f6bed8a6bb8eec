"""A small, strict, lazy safetensors reader (positioned reads + ml_dtypes) for every dtype HF checkpoints use.

The `safetensors` package's NumPy loader fails on F8_E4M3 and BF16 tensors; the
format is simple enough to read directly:

    [8 bytes: little-endian u64 N] [N bytes: JSON header] [data bytes]

The header maps tensor names to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the start
of the data section) plus an optional "__metadata__" {str: str}. A checkpoint is untrusted input, so every
header entry is validated before any tensor is read: header size (<= 100 MB, the reference limit), nesting
(checked before parsing), no key twice, exactly those three fields, a known dtype, a shape of at most 64
non-negative integers, offsets inside the file, byte count == prod(shape) * bits / 8 (sub-byte dtypes F4 /
F6_* included: they are validated but not readable as arrays), and no two tensors overlapping. A sharded
checkpoint's index must map tensor names (str) to shard file names (str) that stay inside the checkpoint
directory (`paths.resolve_inside`), every mapped tensor must be in its shard, and no tensor may be in two shards.
Errors are `ValueError`s naming the file (and the tensor).

With `check_finite=True` (what `models.from_pretrained` passes by default) every tensor is checked for
non-finite values as it is read, chunk by chunk while the chunk is in cache (no extra full-size
temporaries): float tensors (f64/f32/f16/bf16) for NaN/inf, FP8 (e4m3fn NaN codes 0x7F/0xFF, e5m2 inf/NaN)
through their byte patterns, and the uint8 quantization scales: MXFP4 E8M0 `*_scales` (0xFF is NaN) and NVFP4
e4m3 `*.weight_scale` stored as bytes. Packed E2M1 nibbles and integer tensors have no non-finite codes. A hit
raises `NonFiniteTensorError` (a `CheckpointFormatError`, so a `ValueError`) naming the file and tensor.

    f = SafetensorsFile("model.safetensors"); f.keys(); f.get("lm_head.weight")   # np.ndarray copy
    ckpt = open_checkpoint("path/to/model_dir")    # model.safetensors or model.safetensors.index.json shards
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from pallas_kernels.quant import FORMATS

from ..core import empty_aligned, usable_cpus
from ..validation import load_json
from ._paths import resolve_inside
from ._torch_zip import CheckpointFormatError

__all__ = ["DTYPES", "SafetensorsFile", "Checkpoint", "open_checkpoint", "load_safetensors", "NonFiniteTensorError",
           "count_nonfinite"]

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "U8": np.dtype("u1"), "I8": np.dtype("i1"), "I16": np.dtype("<i2"), "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"), "U16": np.dtype("<u2"), "U32": np.dtype("<u4"), "U64": np.dtype("<u8"),
    "BOOL": np.dtype("?"), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
#: bits per element of every dtype a header may declare: the readable DTYPES, and the packed sub-byte floats
#: (validated, but `get` refuses them: NumPy has no packed 4- or 6-bit arrays)
DTYPE_BITS: dict[str, int] = {**{code: dt.itemsize * 8 for code, dt in DTYPES.items()},
                              "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's limit
MAX_INDEX_BYTES = 100 * 1024 * 1024  # an index lists every tensor once: far less than its shards' headers
MAX_RANK = 64  # NumPy's limit on array dimensions
_ENTRY_FIELDS = frozenset({"dtype", "shape", "data_offsets"})
_CHECK_CHUNK_BYTES = 1 << 20  # the finite check reads and checks this much at a time (stays in cache)
_READ_BYTES = 1 << 30  # at most this much per read call (Linux moves at most ~2 GiB per call)
_PARALLEL_READ_BYTES = 32 << 20  # a tensor of at least twice this is read by several threads


@functools.lru_cache(maxsize=1)
def _reader_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that read the parts of large tensors (one per usable CPU, made once)."""
    return concurrent.futures.ThreadPoolExecutor(usable_cpus(), thread_name_prefix="safetensors-read")


class NonFiniteTensorError(CheckpointFormatError):
    """A tensor of a checkpoint holds non-finite values (NaN / inf, or a quantization scale's NaN code).
    Attributes: `path` (the file), `tensor` (its name), `count` (how many values)."""

    def __init__(self, message: str, path: str | os.PathLike | None = None, tensor: str | None = None,
                 count: int = 0):
        super().__init__(message)
        self.path, self.tensor, self.count = path, tensor, count


def _nonfinite_rule(name: str, dtype: np.dtype) -> tuple[str, int, str] | None:
    """(test, bits, description) for a tensor, or None when it has no non-finite codes. test 'isfinite':
    np.isfinite; 'mask': the raw bits x have x & bits == bits (an all-ones exponent); 'equal': x == bits."""
    if dtype.kind == "f":
        return "isfinite", 0, "NaN/inf"
    if dtype == DTYPES["BF16"]:
        return "mask", 0x7F80, "bfloat16 NaN/inf"
    if dtype == DTYPES["F8_E4M3"]:
        return "mask", 0x7F, "float8_e4m3fn NaN codes 0x7F/0xFF"
    if dtype == DTYPES["F8_E5M2"]:
        return "mask", 0x7C, "float8_e5m2 NaN/inf"
    if dtype == np.uint8:  # a quantized format's byte-coded scales (MXFP4 E8M0, NVFP4 e4m3 as bytes)
        for fmt in FORMATS.values():
            rule = fmt.byte_nonfinite(name)
            if rule is not None:
                return rule
    return None


def _scan(rule: tuple[str, int, str], dst: np.ndarray) -> int:
    """The number of non-finite values of the 1-D contiguous `dst` under `rule`, in chunks of ~1 MiB with
    reused scratch buffers (no full-size temporary)."""
    test, pattern, _ = rule
    n = dst.size
    step = max(1, _CHECK_CHUNK_BYTES // dst.itemsize)
    bits = np.dtype(f"<u{dst.itemsize}")
    dst_bits, pattern = dst.view(bits), bits.type(pattern)
    flags = np.empty(min(n, step), bool)
    scratch = np.empty(min(n, step), bits) if test == "mask" else None
    bad = 0
    for i in range(0, n, step):
        j = min(n, i + step)
        f = flags[:j - i]
        if test == "isfinite":
            np.isfinite(dst[i:j], out=f)
            bad += (j - i) - int(np.count_nonzero(f))
            continue
        if test == "mask":
            np.equal(np.bitwise_and(dst_bits[i:j], pattern, out=scratch[:j - i]), pattern, out=f)
        else:
            np.equal(dst_bits[i:j], pattern, out=f)
        bad += int(np.count_nonzero(f))
    return bad


def count_nonfinite(name: str, array: np.ndarray) -> int:
    """How many values of the checkpoint tensor `name` are non-finite, by the rules of the module docstring
    (0 for tensors without non-finite codes); checked in chunks, without a full-size temporary (a
    non-contiguous `array` is copied once)."""
    rule = _nonfinite_rule(name, array.dtype)
    return 0 if rule is None or array.size == 0 else _scan(rule, np.ascontiguousarray(array).reshape(-1))


class SafetensorsFile(Mapping):
    """Lazy read-only view of one .safetensors file; tensors are read on `get` (a NumPy copy each time).

    Also a Mapping name -> np.ndarray, so `dict(f)` loads everything. `check_finite`: `get` raises
    `NonFiniteTensorError` for a tensor with non-finite values (module docstring); off by default here.
    """

    def __init__(self, path: str | os.PathLike, *, check_finite: bool = False):
        self.path = Path(path)
        self.check_finite = bool(check_finite)
        try:
            self._fh = open(self.path, "rb")
        except OSError as e:
            raise ValueError(f"{self.path}: cannot open safetensors file ({e.strerror})") from None
        size = os.fstat(self._fh.fileno()).st_size
        if size < 8:
            self.close()
            raise ValueError(f"{self.path}: truncated safetensors file ({size} bytes, the header length alone is 8)")
        try:
            self._entries, self.metadata = self._parse_header(size)
        except Exception:
            self.close()
            raise

    def _error(self, msg: str) -> ValueError:
        return ValueError(f"{self.path}: {msg}")

    def _parse_header(self, size: int) -> tuple[dict, dict[str, str]]:
        (n,) = struct.unpack("<Q", os.pread(self._fh.fileno(), 8, 0))
        if n > MAX_HEADER_BYTES:
            raise self._error(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit (corrupt file?)")
        if 8 + n > size:
            raise self._error(f"truncated: header length {n} but the file has only {size - 8} bytes after it")
        # bounded parse: nesting checked first, a key twice refused (ValueError naming the file)
        text = os.pread(self._fh.fileno(), n, 8)
        if len(text) != n:
            raise self._error(f"truncated: header length {n} but only {len(text)} bytes could be read")
        header = load_json(text, f"{self.path}: header")
        if not isinstance(header, dict):
            raise self._error(f"header must be a JSON object, got {type(header).__name__}")
        metadata = header.pop("__metadata__", None)
        metadata = {} if metadata is None else metadata
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self._error("__metadata__ must be an object of strings (str -> str)")
        data_start, data_size = 8 + n, size - 8 - n
        entries, spans = {}, []
        for name, info in header.items():
            entries[name] = self._check_entry(name, info, data_start, data_size)
            spans.append((entries[name][2], entries[name][3], name))
        spans.sort()
        for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise self._error(f"tensors {n0!r} [{b0}, {e0}) and {n1!r} [{b1}, {e1}) overlap")
        return entries, dict(metadata)

    def _check_entry(self, name: str, info, data_start: int, data_size: int):
        where = f"tensor {name!r}"
        if not isinstance(info, dict):
            raise self._error(f"{where}: header entry must be an object, got {type(info).__name__}")
        if set(info) != _ENTRY_FIELDS:
            raise self._error(f"{where}: header entry must have exactly the fields {sorted(_ENTRY_FIELDS)}, "
                              f"got {sorted(info)!r:.200}")
        dtype = info["dtype"]
        if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
            raise self._error(f"{where}: unsupported dtype {dtype!r:.80} (known: {sorted(DTYPE_BITS)})")
        shape, offsets = info["shape"], info["data_offsets"]
        if (not isinstance(shape, list) or len(shape) > MAX_RANK
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise self._error(f"{where}: shape must be a list of at most {MAX_RANK} non-negative integers, "
                              f"got {shape!r:.200}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise self._error(f"{where}: data_offsets must be [begin, end] integers, got {offsets!r:.200}")
        begin, end = offsets
        if not 0 <= begin <= end:
            raise self._error(f"{where}: bad data_offsets {offsets}")
        if end > data_size:
            raise self._error(f"{where}: truncated file: data_offsets end {end} beyond the {data_size}-byte "
                              "data section")
        bits = math.prod(shape) * DTYPE_BITS[dtype]  # exact Python ints: no int64 overflow
        if bits % 8:
            raise self._error(f"{where}: shape {shape} x {dtype} is {bits} bits, not a whole number of bytes")
        if end - begin != bits // 8:
            raise self._error(f"{where}: {end - begin} data bytes but shape {shape} x {dtype} needs {bits // 8}")
        return dtype, tuple(shape), data_start + begin, data_start + end

    def keys(self):
        return self._entries.keys()

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name) -> bool:
        return name in self._entries

    def __getitem__(self, name: str) -> np.ndarray:
        self._entry(name)  # KeyError naming the file
        return self.get(name)

    def dtype(self, name: str) -> np.dtype:
        return self._readable_dtype(name, self._entry(name)[0])

    def _readable_dtype(self, name: str, code: str) -> np.dtype:
        """The NumPy dtype of a tensor's dtype code; ValueError naming the tensor for a packed sub-byte one."""
        if code not in DTYPES:
            raise self._error(f"tensor {name!r}: dtype {code} packs several values per byte and cannot be read "
                              "as a NumPy array")
        return DTYPES[code]

    def nbytes(self, name: str) -> int:
        """The data bytes of tensor `name`, from the header (nothing is read)."""
        _, _, begin, end = self._entry(name)
        return end - begin

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1]

    def _entry(self, name: str):
        if name not in self._entries:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        return self._entries[name]

    def get(self, name: str, default=None) -> np.ndarray | None:
        """The tensor `name` as a new NumPy array (its on-disk dtype and shape); `default` if there is no such
        tensor (Mapping semantics; `f[name]` raises a KeyError naming the file instead). With `check_finite`,
        a `NonFiniteTensorError` for a tensor with non-finite values (checked chunk by chunk as it is read)."""
        if name not in self._entries:
            return default
        if self._fh is None:
            raise self._error("file is closed")
        code, shape, begin, end = self._entries[name]
        dtype = self._readable_dtype(name, code)
        n = (end - begin) // dtype.itemsize
        out = empty_aligned(n, dtype)  # aligned: JAX:CPU adopts it without a copy (host_memory)
        rule = _nonfinite_rule(name, dtype) if self.check_finite else None
        bad = self._read_tensor(name, out, begin, rule)
        if bad:
            raise NonFiniteTensorError(
                f"{self.path}: tensor {name!r} ({dtype.name} {list(shape)}) has {bad} non-finite value(s) of {n} "
                f"({rule[2]}); the file is corrupt (flipped bits?). Pass check_finite=False to load it anyway",
                self.path, name, bad)
        return out.reshape(shape)

    def _read_tensor(self, name: str, out: np.ndarray, offset: int, rule: tuple[str, int, str] | None) -> int:
        """Reads the tensor at `offset` into the 1-D array `out`, checking each chunk under `rule` (None: no
        check) while it is in cache; the number of non-finite values. A large tensor is read in contiguous
        parts by every usable CPU at once (positioned reads and NumPy's checks run outside the GIL)."""
        raw = out.view(np.uint8)
        chunk = max(1, _CHECK_CHUNK_BYTES // out.itemsize) * out.itemsize

        def part(lo: int, hi: int) -> int:
            if rule is None:
                self._read_into(name, raw[lo:hi], offset + lo)
                return 0
            bad = 0
            for i in range(lo, hi, chunk):
                j = min(hi, i + chunk)
                self._read_into(name, raw[i:j], offset + i)
                bad += _scan(rule, out[i // out.itemsize:j // out.itemsize])
            return bad

        workers = min(usable_cpus(), raw.size // _PARALLEL_READ_BYTES)
        if workers < 2:
            return part(0, raw.size)
        step = -(-raw.size // (workers * chunk)) * chunk  # whole chunks per part
        bounds = [(lo, min(raw.size, lo + step)) for lo in range(0, raw.size, step)]
        return sum(_reader_pool().map(lambda b: part(*b), bounds))

    def _read_into(self, name: str, dst: np.ndarray, offset: int) -> None:
        """Reads len(dst) bytes at `offset` into the uint8 array dst (the kernel copies from its page cache
        straight into dst: no mapped pages to fault in, no second copy); a file that shrank since its header was
        checked is a ValueError naming the tensor."""
        view, fd = memoryview(dst), self._fh.fileno()
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:done + _READ_BYTES]], offset + done)
            if got <= 0:
                raise self._error(f"tensor {name!r}: the file ends at byte {offset + done}, inside the tensor "
                                  "(truncated since it was opened?)")
            done += got

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype code, shape) of tensor `name` from the header (nothing is read)."""
        code, shape, _, _ = self._entry(name)
        return code, shape

    def close(self) -> None:
        if getattr(self, "_fh", None) is not None:
            self._fh.close()
        self._fh = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self)} tensors)"


class Checkpoint(Mapping):
    """Tensors of a (possibly sharded) checkpoint directory, by name; lazy like SafetensorsFile."""

    def __init__(self, files: Mapping[str, SafetensorsFile], where: Mapping[str, str]):
        self._files, self._where = dict(files), dict(where)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return self._files[self._where[name]].get(name)

    def get(self, name: str, default=None):
        return self[name] if name in self._where else default

    def __contains__(self, name) -> bool:
        return name in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def info(self, name: str) -> tuple[str, tuple[int, ...], Path]:
        """(safetensors dtype code, shape, file) of tensor `name`, from its shard's header (nothing is read)."""
        if name not in self._where:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        f = self._files[self._where[name]]
        return f.info(name) + (f.path,)

    def nbytes(self, name: str | None = None) -> int:
        """The data bytes of tensor `name`, or of every tensor (None), from the headers (nothing is read)."""
        if name is not None:
            if name not in self._where:
                raise KeyError(f"checkpoint has no tensor {name!r}")
            return self._files[self._where[name]].nbytes(name)
        return sum(self._files[shard].nbytes(n) for n, shard in self._where.items())

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def load_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a safetensors file as NumPy arrays (any dtype, bfloat16 and float8 included; every header
    entry validated before reading)."""
    with SafetensorsFile(path) as f:
        return {name: f[name] for name in f.keys()}


def open_checkpoint(path: str | os.PathLike, *, check_finite: bool = False) -> Checkpoint:
    """Opens `path`: a .safetensors file, or a directory with `model.safetensors` or the sharded
    `model.safetensors.index.json` (its `weight_map` names each tensor's shard). `check_finite`: each tensor
    read is checked for non-finite values (`NonFiniteTensorError`, see the module docstring)."""
    path = Path(path)
    if path.is_file():
        f = SafetensorsFile(path, check_finite=check_finite)
        return Checkpoint({f.path.name: f}, {k: f.path.name for k in f.keys()})
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_weight_map(index)
        # every shard name stays inside the checkpoint directory before any file is opened
        shards = {shard: resolve_inside(path, shard, f"{index}: weight_map shard")
                  for shard in sorted(set(weight_map.values()))}
        for shard, shard_path in shards.items():
            if not shard_path.is_file():
                raise ValueError(f"{index}: shard {shard!r} is missing from {path}")
        files: dict[str, SafetensorsFile] = {}
        try:
            for shard, shard_path in shards.items():
                files[shard] = SafetensorsFile(shard_path, check_finite=check_finite)
            _check_shards(index, files, weight_map)
        except BaseException:
            for f in files.values():
                f.close()
            raise
        return Checkpoint(files, weight_map)
    single = path / "model.safetensors"
    if single.is_file():
        return open_checkpoint(single, check_finite=check_finite)
    raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json")


def _read_weight_map(index: Path) -> dict[str, str]:
    """The `weight_map` of a safetensors index file: a JSON object of tensor name (str) -> shard file name
    (non-empty str). ValueError naming the index otherwise (its size is checked before it is read)."""
    size = index.stat().st_size
    if size > MAX_INDEX_BYTES:
        raise ValueError(f"{index}: {size} bytes exceed the {MAX_INDEX_BYTES}-byte limit of a safetensors index")
    data = load_json(index.read_bytes(), str(index))
    if not isinstance(data, dict) or "weight_map" not in data:
        raise ValueError(f"{index}: not a safetensors index (needs a 'weight_map' object)")
    weight_map = data["weight_map"]
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: weight_map must be an object of tensor name -> shard file name, got "
                         f"{type(weight_map).__name__}")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise ValueError(f"{index}: weight_map[{name!r:.200}] must be a shard file name (a non-empty "
                             f"string), got {shard!r:.80}")
    return weight_map


def _check_shards(index: Path, files: Mapping[str, SafetensorsFile], weight_map: Mapping[str, str]) -> None:
    """ValueError naming the index, the tensor and the files: a tensor held by two shards (which one would be
    read?), or a tensor of weight_map that its shard does not hold."""
    owner: dict[str, str] = {}
    for shard, f in files.items():
        for name in f.keys():
            other = owner.setdefault(name, shard)
            if other != shard:
                raise ValueError(f"{index}: tensor {name!r} is in two shards, {other!r} and {shard!r}")
    for name, shard in weight_map.items():
        if name not in files[shard]:
            raise ValueError(f"{index}: tensor {name!r} is mapped to {shard!r}, which does not hold it")
