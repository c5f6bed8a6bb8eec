"""A byte-level training corpus of source files, with batches that depend only on (seed, step).

    train = ByteCorpus()                                   # the Python standard library's *.py files
    val = ByteCorpus(split="validation")
    x = train.batch(step, batch_size=32, seq_len=256)       # int32 [32, 257]: inputs x[:, :-1], targets x[:, 1:]
    for step, x in train.batches(32, 256, start_step=resumed_step):   # prefetched in a background thread
        ...
    eval_set = val.eval_batches(32, 256, num_batches=8)    # the same list of int32 [32, 257] on every call

Layout of `data`: the files of the split in sorted relative-path order, each file's bytes followed by one
separator byte `SEPARATOR` (0). Byte 0 does not occur in Python source text (CPython refuses source with a NUL
byte; the standard library's .py files contain none), so the separator marks file boundaries unambiguously; a
file that contains it anyway is refused (or skipped and recorded with `skip_unreadable=True`).

Train/validation split: by relative path, never by content. A file goes to validation when
`int.from_bytes(sha256(posix_path.encode('utf-8')).digest()[:8], 'big') % 10_000 < val_fraction * 10_000`, so
the split is the same on every machine and in every run for the same file set, and editing a file cannot move
it to the other split.

Several processes: the window starts depend only on (seed, step), so every process computes the same global
batch and keeps its rows with `local_rows(batch, process_index, process_count)`.

Plain Python + NumPy (no JAX), so a loader thread never touches a device.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import numbers
import os
import queue
import sysconfig
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ..validation import check_choice, check_int

__all__ = ["ByteCorpus", "BatchIterator", "SEPARATOR", "SPLITS", "local_rows", "split_of"]

SEPARATOR = 0
SPLITS = ("train", "validation")
_BUCKETS = 10_000
# Third-party packages installed inside the stdlib folder are not the standard library.
DEFAULT_EXCLUDE_DIRS = ("site-packages", "dist-packages")


def _count(name: str, value: object, minimum: int) -> int:
    """`value` as an int >= minimum (NumPy integers accepted, bools refused), else a ValueError naming `name`."""
    return check_int(value, name, minimum=minimum)


def split_of(rel_path: str, val_fraction: float) -> str:
    """'validation' or 'train' for a file's relative posix path (see the module docstring for the rule)."""
    digest = hashlib.sha256(rel_path.encode("utf-8", "surrogateescape")).digest()
    bucket = int.from_bytes(digest[:8], "big") % _BUCKETS
    return "validation" if bucket < val_fraction * _BUCKETS else "train"


def _pattern_segments(pattern: object) -> tuple[str, ...]:
    """'**/*.py' -> ('**', '*.py'); a ValueError naming `pattern` unless it is a relative glob."""
    segments = tuple(pattern.split("/")) if isinstance(pattern, str) else ()
    if (not segments or pattern.startswith("/") or any(seg in ("", ".", "..") for seg in segments)
            or segments[-1] == "**"):
        raise ValueError(f"pattern must be a relative glob of '/'-separated parts such as '**/*.py' (no empty, "
                         f"'.' or '..' part, not ending in '**'), got {pattern!r}")
    return segments


def _matches(parts: tuple[str, ...], segments: tuple[str, ...]) -> bool:
    """Whether a relative path's parts match the glob segments: '**' is any number of folders, other segments
    follow `fnmatch.fnmatchcase` (case-sensitive; '*' also matches names starting with '.')."""
    if not segments:
        return not parts
    if segments[0] == "**":
        return any(_matches(parts[i:], segments[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], segments[0]) and _matches(parts[1:], segments[1:])


def _list_files(root: Path, segments: tuple[str, ...], exclude_dirs: frozenset[str]
                ) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """(sorted relative posix paths of the files matching, excluded folders, (folder, why) it cannot be listed).

    Walks with `os.walk` (links to folders are not followed, so there are no cycles; links to files are read
    like files) instead of `Path.glob`, which skips unreadable folders without a word.
    """
    errors: list[OSError] = []
    files, excluded = [], []
    for folder, subfolders, names in os.walk(root, onerror=errors.append):
        rel = Path(folder).relative_to(root)
        excluded += [(rel / d).as_posix() for d in subfolders if d in exclude_dirs]
        subfolders[:] = [d for d in subfolders if d not in exclude_dirs]
        files += [(rel / n).as_posix() for n in names if _matches((rel / n).parts, segments)]
    unlisted = [(Path(os.fsdecode(e.filename)).relative_to(root).as_posix(), f"folder cannot be listed: {e}")
                for e in errors if e.filename is not None]
    if len(unlisted) < len(errors):
        raise ValueError(f"listing corpus root {str(root)!r} failed: {errors[0]}")
    return sorted(files), sorted(excluded), sorted(unlisted)


def _read(path: Path) -> tuple[bytes | None, str]:
    """(the file's bytes, '') or (None, why it cannot be used)."""
    if not path.is_file():
        return None, "is not a regular file (a broken link, a pipe or a device)"
    try:
        content = path.read_bytes()
    except OSError as exc:
        return None, f"cannot be read: {exc}"
    nul = content.find(bytes([SEPARATOR]))
    if nul >= 0:
        return None, f"contains byte {SEPARATOR} (the file separator) at offset {nul}"
    return content, ""


def _check_root(root: Path) -> None:
    if not root.exists():
        raise ValueError(f"corpus root {str(root)!r} does not exist")
    if not root.is_dir():
        raise ValueError(f"corpus root {str(root)!r} is not a directory")
    try:
        with os.scandir(root):
            pass
    except OSError as exc:
        raise ValueError(f"corpus root {str(root)!r} cannot be read: {exc}") from None


def _concatenate(chunks: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """(np.uint8 [N] of every chunk followed by SEPARATOR, np.int64 [F + 1] chunk starts), both read-only."""
    lengths = np.array([len(c) + 1 for c in chunks], np.int64)
    offsets = np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths)])
    buffer = bytearray(int(offsets[-1]))       # zero-filled, so every separator is already in place
    for start, content in zip(offsets[:-1].tolist(), chunks):
        buffer[start:start + len(content)] = content
    offsets.flags.writeable = False
    return np.frombuffer(bytes(buffer), np.uint8), offsets


class ByteCorpus:
    """The bytes of one split of the source files under `root`, concatenated, as `data` (np.uint8 [N]).

    Args:
      root: folder to read; None means the Python standard library (`sysconfig.get_paths()['stdlib']`).
      split: 'train' or 'validation'.
      val_fraction: in (0, 1); the expected share of files that go to validation.
      pattern: glob of the files' paths relative to `root` ('**' = any number of folders, then
        `fnmatch` per part), e.g. '**/*.py' or 'json/*.py'.
      max_bytes: None, or keep only the split's first files (sorted order) whose bytes plus separators fit in
        `max_bytes`; stops at the first file that does not fit. For quick runs.
      skip_unreadable: False raises on a file that cannot be read or contains the separator byte, or a folder
        that cannot be listed; True leaves it out and records (relative path, reason) in `skipped`.
      exclude_dirs: folders with one of these names are not entered; their relative paths are in `excluded`
        (by default the third-party package folders that live inside the stdlib folder).

    Files are ordered by their relative posix path as a string (code-point order, so 'a.b.py' < 'a/b.py').
    Raises ValueError (naming the argument or path) for a missing, non-folder or unreadable root, no matching
    files, an empty split, an unknown split, val_fraction outside (0, 1), or a bad max_bytes or pattern.
    """

    def __init__(self, root: str | os.PathLike | None = None, split: str = "train", val_fraction: float = 0.05,
                 pattern: str = "**/*.py", max_bytes: int | None = None, skip_unreadable: bool = False,
                 exclude_dirs: Sequence[str] = DEFAULT_EXCLUDE_DIRS):
        check_choice(split, "split", SPLITS)
        if (isinstance(val_fraction, bool) or not isinstance(val_fraction, numbers.Real)
                or not 0.0 < float(val_fraction) < 1.0):
            raise ValueError(f"val_fraction must be a number in the open interval (0, 1), got {val_fraction!r}")
        segments = _pattern_segments(pattern)
        if max_bytes is not None:
            max_bytes = _count("max_bytes", max_bytes, 1)
        if isinstance(exclude_dirs, str) or not all(isinstance(d, str) for d in exclude_dirs):
            raise ValueError(f"exclude_dirs must be a sequence of folder names, got {exclude_dirs!r}")
        root = Path(sysconfig.get_paths()["stdlib"] if root is None else root)
        _check_root(root)
        val_fraction = float(val_fraction)

        all_files, excluded, unlisted = _list_files(root, segments, frozenset(exclude_dirs))
        if unlisted and not skip_unreadable:
            raise ValueError(f"corpus folder {str(root / unlisted[0][0])!r}: {unlisted[0][1]}")
        if not all_files:
            raise ValueError(f"no files under corpus root {str(root)!r} match pattern {pattern!r}"
                             + (f" (folders excluded: {excluded})" if excluded else ""))
        in_split = [p for p in all_files if split_of(p, val_fraction) == split]
        if not in_split:
            raise ValueError(f"the {split!r} split of corpus root {str(root)!r} is empty: none of its "
                             f"{len(all_files)} files matching {pattern!r} falls in it with "
                             f"val_fraction={val_fraction}")

        files, chunks, skipped, size, too_big = [], [], list(unlisted), 0, None
        for rel in in_split:
            content, reason = _read(root / rel)
            if content is None:
                if not skip_unreadable:
                    raise ValueError(f"corpus file {str(root / rel)!r} {reason}")
                skipped.append((rel, reason))
                continue
            if max_bytes is not None and size + len(content) + 1 > max_bytes:
                too_big = (rel, len(content) + 1)
                break
            files.append(rel)
            chunks.append(content)
            size += len(content) + 1
        if not files:
            why = (f"its first usable file {too_big[0]!r} needs {too_big[1]} bytes > max_bytes={max_bytes}"
                   if too_big else f"all {len(in_split)} of its files were skipped as unreadable")
            raise ValueError(f"the {split!r} split of corpus root {str(root)!r} is empty: {why}")

        self._data, self._offsets = _concatenate(chunks)   # read-only: shared by every batch
        self._files, self._skipped, self._excluded = tuple(files), tuple(skipped), tuple(excluded)
        self.root, self.split, self.val_fraction, self.pattern = root, split, val_fraction, pattern

    # -- contents ---------------------------------------------------------------------------------------------

    @property
    def files(self) -> tuple[str, ...]:
        """Relative posix paths of the files in `data`, in their order there."""
        return self._files

    @property
    def data(self) -> np.ndarray:
        """np.uint8 [N], read-only: each file's bytes followed by `SEPARATOR`."""
        return self._data

    @property
    def num_bytes(self) -> int:
        """N, the length of `data` (separators included)."""
        return int(self._data.shape[0])

    @property
    def offsets(self) -> np.ndarray:
        """np.int64 [F + 1]: file i occupies data[offsets[i]:offsets[i+1] - 1]; its separator is at offsets[i+1]-1."""
        return self._offsets

    @property
    def skipped(self) -> tuple[tuple[str, str], ...]:
        """(relative path, reason) of each file of the split (or folder) left out with `skip_unreadable=True`."""
        return self._skipped

    @property
    def excluded(self) -> tuple[str, ...]:
        """Relative posix paths of the folders not entered because of `exclude_dirs`."""
        return self._excluded

    def __repr__(self) -> str:
        return (f"ByteCorpus(root={str(self.root)!r}, split={self.split!r}, files={len(self._files)}, "
                f"num_bytes={self.num_bytes}, skipped={len(self._skipped)}, excluded={len(self._excluded)})")

    # -- batches ----------------------------------------------------------------------------------------------

    def _window(self, batch_size: int, seq_len: int) -> tuple[int, int]:
        batch_size = _count("batch_size", batch_size, 1)
        seq_len = _count("seq_len", seq_len, 1)
        if self.num_bytes < seq_len + 1:
            raise ValueError(f"seq_len={seq_len} needs windows of {seq_len + 1} bytes but the {self.split!r} corpus "
                             f"of {str(self.root)!r} holds only {self.num_bytes} bytes")
        return batch_size, seq_len

    def batch_starts(self, step: int, batch_size: int, seq_len: int, seed: int = 0) -> np.ndarray:
        """np.int64 [B]: window starts of `batch`, uniform in [0, N - seq_len - 1], from default_rng([seed, step])."""
        batch_size, seq_len = self._window(batch_size, seq_len)
        rng = np.random.default_rng([_count("seed", seed, 0), _count("step", step, 0)])
        return rng.integers(0, self.num_bytes - seq_len, size=batch_size, dtype=np.int64)

    def batch(self, step: int, batch_size: int, seq_len: int, seed: int = 0) -> np.ndarray:
        """int32 [B, seq_len + 1]: B windows data[s:s + seq_len + 1]; a function of (seed, step) only.

        Inputs are batch[:, :-1] and next-byte targets batch[:, 1:]. Windows may span a file separator.
        """
        starts = self.batch_starts(step, batch_size, seq_len, seed)
        return self._data[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)

    def batches(self, batch_size: int, seq_len: int, seed: int = 0, start_step: int = 0,
                prefetch: int = 2) -> BatchIterator:
        """Endless iterator of (step, batch(step, ...)) from `start_step`, prepared `prefetch` ahead in a thread."""
        self._window(batch_size, seq_len)     # bad arguments fail here, not in the thread
        _count("seed", seed, 0)
        make = functools.partial(self.batch, batch_size=batch_size, seq_len=seq_len, seed=seed)
        return BatchIterator(make, _count("start_step", start_step, 0), _count("prefetch", prefetch, 1))

    def eval_batches(self, batch_size: int, seq_len: int, num_batches: int) -> list[np.ndarray]:
        """A fixed evaluation set: `num_batches` arrays int32 [B, seq_len + 1] of non-overlapping windows.

        The W = B * num_batches windows of L = seq_len + 1 bytes start at i * stride, stride = (N - L) // (W - 1)
        (>= L, so they never overlap; exactly L, consecutive from the start, when N == W * L); batch j holds
        windows j*B .. j*B + B - 1. No randomness: identical on every call and every machine.
        """
        batch_size, seq_len = self._window(batch_size, seq_len)
        num_batches = _count("num_batches", num_batches, 1)
        count, length = batch_size * num_batches, seq_len + 1
        if count * length > self.num_bytes:
            raise ValueError(f"eval_batches needs {count} non-overlapping windows of {length} bytes "
                             f"(batch_size={batch_size} x num_batches={num_batches}, seq_len={seq_len}) = "
                             f"{count * length} bytes, but the {self.split!r} corpus of {str(self.root)!r} holds "
                             f"{self.num_bytes}")
        stride = length if count == 1 else (self.num_bytes - length) // (count - 1)
        starts = np.arange(count, dtype=np.int64) * stride
        windows = self._data[starts[:, None] + np.arange(length)].astype(np.int32)
        return [windows[j * batch_size:(j + 1) * batch_size] for j in range(num_batches)]


def local_rows(batch: np.ndarray, process_index: int, process_count: int) -> np.ndarray:
    """The contiguous rows of a global batch [B, ...] that process `process_index` of `process_count` holds.

    Returns batch[i * B/P : (i + 1) * B/P] (a view). Raises ValueError if B is not divisible by process_count.
    """
    process_count = _count("process_count", process_count, 1)
    process_index = _count("process_index", process_index, 0)
    if process_index >= process_count:
        raise ValueError(f"process_index must be in [0, {process_count}), got {process_index}")
    if np.ndim(batch) < 1:
        raise ValueError(f"batch must have a leading batch axis, got shape {np.shape(batch)}")
    rows = batch.shape[0]
    if rows % process_count:
        raise ValueError(f"batch size {rows} (batch.shape[0]) is not divisible by process_count={process_count}")
    per = rows // process_count
    return batch[process_index * per:(process_index + 1) * per]


class _Failure:
    """An exception raised in the loader thread, carried to the consumer."""

    def __init__(self, exc: Exception):
        self.exc = exc


def _produce(make: Callable[[int], np.ndarray], step: int, out: queue.Queue, stop: threading.Event) -> None:
    # Holds no reference to the BatchIterator, so dropping the iterator lets its finalizer stop this loop.
    while not stop.is_set():
        try:
            item: object = (step, make(step))
        except Exception as exc:  # noqa: BLE001 - every failure is re-raised in the consumer
            item = _Failure(exc)
        while not stop.is_set():
            try:
                out.put(item, timeout=0.05)
                break
            except queue.Full:
                continue
        if isinstance(item, _Failure):
            return
        step += 1


def _signal_stop(stop: threading.Event, out: queue.Queue) -> None:
    stop.set()
    while True:      # free the slots so a blocked put returns at once
        try:
            out.get_nowait()
        except queue.Empty:
            return


class BatchIterator:
    """Iterator of (step, batch) filled by a daemon thread through a queue of `prefetch` slots.

    `close()` (or leaving a `with` block, or garbage collection) stops the thread; an exception raised while
    preparing a batch is raised again by the `next()` that would have returned that batch, and ends the iterator.
    """

    def __init__(self, make: Callable[[int], np.ndarray], start_step: int, prefetch: int):
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=_produce, args=(make, start_step, self._queue, self._stop),
                                        name="ByteCorpus.batches", daemon=True)
        self._finalizer = weakref.finalize(self, _signal_stop, self._stop, self._queue)
        self._thread.start()

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> tuple[int, np.ndarray]:
        while True:
            if self._stop.is_set():
                raise StopIteration
            try:
                item = self._queue.get(timeout=0.1)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self.close()
                    raise RuntimeError("the ByteCorpus.batches loader thread ended without a result") from None
        if isinstance(item, _Failure):
            self.close()
            raise item.exc
        return item

    def close(self) -> None:
        """Stop the loader thread and wait for it; later `next()` calls raise StopIteration."""
        self._finalizer()
        if self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def closed(self) -> bool:
        """True once `close()` ran or the iterator ended with an error."""
        return self._stop.is_set()

    def __enter__(self) -> BatchIterator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
