"""Streaming, sharded safetensors writer: tensors are written chunk by chunk, never a whole shard in memory.

    plan = plan_shards([TensorInfo("lm_head.weight", "BF16", (V, M)), ...], max_shard_bytes=5 * 10**9)
    for shard in plan:                       # model-00001-of-0000n.safetensors, ...
        write_shard(directory / shard.filename, shard.tensors, fill)   # fill(info, out_file) writes its bytes
    write_index(directory, plan)             # model.safetensors.index.json (weight_map + total_size)

A shard is written to `<name>.partial` and renamed after an fsync, so a file under its final name is always
complete; `shard_is_complete` checks an existing one (size and header) so an interrupted run can resume.
Tensors keep the plan's order in each shard (HF writes them in module order); the header is padded with spaces
to a multiple of 8 bytes, as the reference writer does.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

from ._safetensors_io import DTYPES

__all__ = ["TensorInfo", "Shard", "plan_shards", "write_shard", "shard_is_complete", "write_index",
           "HF_MAX_SHARD_BYTES"]

HF_MAX_SHARD_BYTES = 5 * 10**9  # save_pretrained's default max_shard_size "5GB"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor to write: its name, safetensors dtype code ('BF16', 'U8', 'F8_E4M3', ...) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


@dataclasses.dataclass(frozen=True)
class Shard:
    """One file of a sharded checkpoint: its name and tensors (in file order)."""

    filename: str
    tensors: tuple[TensorInfo, ...]

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def header(self) -> bytes:
        """The 8-byte length + JSON header (space-padded to a multiple of 8) of this shard."""
        entries, offset = {}, 0
        for t in self.tensors:
            entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        entries["__metadata__"] = {"format": "pt"}
        text = json.dumps(entries, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        return struct.pack("<Q", len(text)) + text

    def file_bytes(self) -> int:
        return len(self.header()) + self.data_bytes


def plan_shards(tensors: Sequence[TensorInfo], max_shard_bytes: int = HF_MAX_SHARD_BYTES) -> list[Shard]:
    """Splits `tensors` (in order) into shards of at most `max_shard_bytes` data bytes each (a tensor larger
    than that gets a shard of its own), named `model-0000i-of-0000n.safetensors`; one shard is
    `model.safetensors`. ValueError for a duplicate name, an unknown dtype or a negative dimension."""
    seen = set()
    for t in tensors:
        if t.name in seen:
            raise ValueError(f"plan_shards: tensor {t.name!r} appears twice")
        if t.dtype not in DTYPES:
            raise ValueError(f"plan_shards: tensor {t.name!r} has unknown dtype {t.dtype!r} (known: {sorted(DTYPES)})")
        if any(d < 0 for d in t.shape):
            raise ValueError(f"plan_shards: tensor {t.name!r} has a negative dimension {t.shape}")
        seen.add(t.name)
    groups: list[list[TensorInfo]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    n = len(groups)
    if n == 1:
        return [Shard("model.safetensors", tuple(groups[0]))]
    return [Shard(f"model-{i + 1:05d}-of-{n:05d}.safetensors", tuple(g)) for i, g in enumerate(groups)]


def shard_is_complete(path: str | os.PathLike, shard: Shard) -> bool:
    """Whether `path` holds exactly this shard's header and size (a finished earlier write)."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size != shard.file_bytes():
        return False
    header = shard.header()
    with open(path, "rb") as f:
        return f.read(len(header)) == header


def write_shard(path: str | os.PathLike, shard: Shard, fill: Callable[[TensorInfo, BinaryIO], None]) -> None:
    """Writes `shard` to `path` atomically: the header, then `fill(info, f)` for each tensor, which must write
    exactly `info.nbytes` bytes to `f` (checked: a RuntimeError names the tensor otherwise)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    try:
        with open(tmp, "wb") as f:
            f.write(shard.header())
            for t in shard.tensors:
                start = f.tell()
                fill(t, f)
                if f.tell() - start != t.nbytes:
                    raise RuntimeError(f"{path}: tensor {t.name!r}: wrote {f.tell() - start} bytes, "
                                       f"expected {t.nbytes}")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_index(directory: str | os.PathLike, shards: Sequence[Shard]) -> Path | None:
    """Writes `model.safetensors.index.json` (metadata.total_size + weight_map) for a multi-shard plan,
    atomically; None (nothing written) for a single `model.safetensors`."""
    if len(shards) == 1:
        return None
    index = {"metadata": {"total_size": sum(s.data_bytes for s in shards)},
             "weight_map": {t.name: s.filename for s in shards for t in s.tensors}}
    path = Path(directory) / "model.safetensors.index.json"
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(index, indent=2) + "\n")
    os.replace(tmp, path)
    return path
