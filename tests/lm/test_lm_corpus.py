"""`tutel_jax.lm._corpus`: the byte corpus, its path-hash split, step-keyed batches, the prefetching iterator,
the fixed evaluation set and `local_rows`.

References are independent: the split is recomputed here with hashlib, the layout by concatenating the files'
bytes, the windows by NumPy slices at starts drawn from `np.random.default_rng([seed, step])`. All comparisons are
exact (integer data).
"""

from __future__ import annotations

import gc
import hashlib
import os
import re
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from tutel_jax.lm import _corpus as corpus_mod
from tutel_jax.lm._corpus import SEPARATOR, ByteCorpus, local_rows

# Names chosen so that string order differs from Path order ('a.b.py' < 'a/b.py' < 'a_b.py', 'B' < 'a').
TRICKY = ("a.b.py", "a/b.py", "a_b.py", "B.py", ".hidden.py")


def ref_split(rel: str, val_fraction: float) -> str:
    bucket = int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:8], "big") % 10_000
    return "validation" if bucket < val_fraction * 10_000 else "train"


def write_tree(root: Path, salt: str = "") -> list[str]:
    """24 modules of different lengths plus TRICKY names; also non-matching and excluded files. Returns the
    relative paths of the matching files, sorted as strings."""
    rels = [f"pkg{i % 4}/mod_{i}.py" for i in range(24)] + list(TRICKY)
    for i, rel in enumerate(rels):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes((f"# {salt} module {i}\n" * (i + 1) + f"x = {i}\n").encode())
    (root / "pkg0" / "notes.txt").write_text("not python\n")
    (root / "site-packages" / "third").mkdir(parents=True)
    (root / "site-packages" / "third" / "party.py").write_text("import os\n")
    return sorted(rels)


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, list[str]]:
    return tmp_path / "src", write_tree(tmp_path / "src")


def walk_listing(root: Path, suffix: str, exclude: tuple[str, ...]) -> list[str]:
    """Relative posix paths of the files under root ending with suffix, outside folders named in exclude."""
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in exclude]
        found += [Path(folder, n).relative_to(root).as_posix() for n in names if n.endswith(suffix)]
    return sorted(found)


def small_corpus(tmp_path: Path, content: bytes) -> ByteCorpus:
    """One-file train corpus holding `content` + separator (val_fraction tiny, so the file is in train)."""
    assert ref_split("only.py", 1e-4) == "train"
    (tmp_path / "only.py").write_bytes(content)
    return ByteCorpus(tmp_path, val_fraction=1e-4)


# -- split and layout ---------------------------------------------------------------------------------------------

def test_split_deterministic_disjoint_covering(tree):
    root, rels = tree
    train = ByteCorpus(root, "train", val_fraction=0.3)
    val = ByteCorpus(root, "validation", val_fraction=0.3)
    assert train.files == tuple(r for r in rels if ref_split(r, 0.3) == "train")
    assert val.files == tuple(r for r in rels if ref_split(r, 0.3) == "validation")
    assert train.files and val.files and not set(train.files) & set(val.files)
    assert sorted(train.files + val.files) == rels
    assert train.excluded == ("site-packages",)
    again = ByteCorpus(root, "train", val_fraction=0.3)
    assert again.files == train.files and np.array_equal(again.data, train.data)


def test_split_by_path_not_content(tree):
    root, rels = tree
    before = ByteCorpus(root, "validation", val_fraction=0.3)
    for i, rel in enumerate(rels):
        (root / rel).write_bytes(f"edited {i}\n".encode() * (50 - i))
    after = ByteCorpus(root, "validation", val_fraction=0.3)
    assert after.files == before.files
    assert not np.array_equal(after.data[:64], before.data[:64])


def test_data_layout_and_order(tree):
    root, rels = tree
    train = ByteCorpus(root, "train", val_fraction=0.3)
    assert list(train.files) == sorted(train.files)      # code-point order of the posix strings
    expected = b"".join((root / r).read_bytes() + bytes([SEPARATOR]) for r in train.files)
    assert train.data.dtype == np.uint8 and train.data.shape == (len(expected),)
    assert train.data.tobytes() == expected and train.num_bytes == len(expected)
    assert not train.data.flags.writeable
    for i, rel in enumerate(train.files):
        lo, hi = train.offsets[i], train.offsets[i + 1]
        assert train.data[lo:hi - 1].tobytes() == (root / rel).read_bytes() and train.data[hi - 1] == SEPARATOR
    # the ordering rule itself, on the names chosen for it
    assert [r for r in rels if r in TRICKY] == [".hidden.py", "B.py", "a.b.py", "a/b.py", "a_b.py"]


def test_pattern_and_exclude_dirs(tree):
    root, _ = tree
    txt = ByteCorpus(root, pattern="**/*.txt", val_fraction=1e-4)
    assert txt.files == ("pkg0/notes.txt",)
    one_folder = ByteCorpus(root, pattern="pkg1/*.py", val_fraction=0.3)
    assert one_folder.files and all(re.fullmatch(r"pkg1/mod_\d+\.py", f) for f in one_folder.files)
    everything = ByteCorpus(root, "train", val_fraction=0.3, exclude_dirs=())
    expected = ref_split("site-packages/third/party.py", 0.3) == "train"
    assert ("site-packages/third/party.py" in everything.files) == expected and everything.excluded == ()


def test_max_bytes_keeps_first_whole_files(tree):
    root, _ = tree
    full = ByteCorpus(root, "train", val_fraction=0.3)
    limit = int(full.offsets[3]) + 5       # room for three files and part of the fourth
    cut = ByteCorpus(root, "train", val_fraction=0.3, max_bytes=limit)
    assert cut.files == full.files[:3]
    assert np.array_equal(cut.data, full.data[:full.offsets[3]])
    assert ByteCorpus(root, "train", val_fraction=0.3, max_bytes=int(full.offsets[3])).files == full.files[:3]
    first = full.offsets[1]
    with pytest.raises(ValueError, match=rf"{re.escape(full.files[0])}.*needs {first} bytes > max_bytes={first - 1}"):
        ByteCorpus(root, "train", val_fraction=0.3, max_bytes=int(first) - 1)


def test_unusable_files_raise_or_are_recorded(tree):
    root, rels = tree
    nul_name = next(f"bad_{i}.py" for i in range(1000) if ref_split(f"bad_{i}.py", 0.3) == "train")
    (root / nul_name).write_bytes(b"x = 1\n\x00y = 2\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(root / nul_name))}.*byte 0 .*offset 6"):
        ByteCorpus(root, "train", val_fraction=0.3)
    link = next(f"link_{i}.py" for i in range(1000) if ref_split(f"link_{i}.py", 0.3) == "train")
    os.symlink(root / "does_not_exist.py", root / link)
    kept = ByteCorpus(root, "train", val_fraction=0.3, skip_unreadable=True)
    assert dict(kept.skipped).keys() == {nul_name, link}
    assert "byte 0" in dict(kept.skipped)[nul_name] and "not a regular file" in dict(kept.skipped)[link]
    assert kept.files == tuple(r for r in rels if ref_split(r, 0.3) == "train")
    (root / nul_name).unlink()
    with pytest.raises(ValueError, match=rf"{re.escape(str(root / link))}.*not a regular file"):
        ByteCorpus(root, "train", val_fraction=0.3)


def test_unreadable_root_and_folder(tree, monkeypatch):
    root, _ = tree
    real_scandir = os.scandir

    def refuse(path=".", _real=real_scandir):
        if Path(path) == root / "pkg2":
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return _real(path)

    with monkeypatch.context() as m:
        m.setattr(os, "scandir", refuse)
        with pytest.raises(ValueError, match=rf"{re.escape(str(root / 'pkg2'))}.*cannot be listed"):
            ByteCorpus(root, val_fraction=0.3)
        kept = ByteCorpus(root, val_fraction=0.3, skip_unreadable=True)
    assert ("pkg2", ) == tuple(p for p, why in kept.skipped if "cannot be listed" in why)
    assert kept.files and not any(f.startswith("pkg2/") for f in kept.files)

    def refuse_all(path="."):
        raise PermissionError(13, "Permission denied", os.fspath(path))

    with monkeypatch.context() as m:
        m.setattr(os, "scandir", refuse_all)
        with pytest.raises(ValueError, match=rf"corpus root {re.escape(repr(str(root)))} cannot be read"):
            ByteCorpus(root)


def test_constructor_errors(tmp_path, tree):
    root, _ = tree
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match=rf"{re.escape(str(missing))}.*does not exist"):
        ByteCorpus(missing)
    with pytest.raises(ValueError, match=rf"{re.escape(str(root / 'B.py'))}.*not a directory"):
        ByteCorpus(root / "B.py")
    with pytest.raises(ValueError, match=r"no files under .* match pattern '\*\*/\*\.rs'"):
        ByteCorpus(root, pattern="**/*.rs")
    only_excluded = tmp_path / "x"
    (only_excluded / "site-packages").mkdir(parents=True)
    (only_excluded / "site-packages" / "m.py").write_text("pass\n")
    with pytest.raises(ValueError, match=r"no files .*folders excluded: \['site-packages'\]"):
        ByteCorpus(only_excluded)
    assert all(ref_split(r, 1e-4) == "train" for r in write_tree(tmp_path / "t"))
    with pytest.raises(ValueError, match=r"'validation' split .* is empty.*val_fraction=0.0001"):
        ByteCorpus(tmp_path / "t", "validation", val_fraction=1e-4)
    with pytest.raises(ValueError, match=r"split must be one of \('train', 'validation'\), got 'test'"):
        ByteCorpus(root, "test")
    for bad in (0, 0.0, 1, 1.0, -0.1, 1.5, float("nan"), "0.1", True):
        with pytest.raises(ValueError, match=r"val_fraction must be a number in the open interval \(0, 1\)"):
            ByteCorpus(root, val_fraction=bad)
    for bad in ("/abs/*.py", "", "a//b.py", "../*.py", "**", 3):
        with pytest.raises(ValueError, match=r"pattern must be a relative glob"):
            ByteCorpus(root, pattern=bad)
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match=r"max_bytes must be an integer >= 1"):
            ByteCorpus(root, max_bytes=bad)
    with pytest.raises(ValueError, match=r"exclude_dirs must be a sequence of folder names"):
        ByteCorpus(root, exclude_dirs="site-packages")


# -- batches ------------------------------------------------------------------------------------------------------

def ref_batch(data: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int) -> np.ndarray:
    starts = np.random.default_rng([seed, step]).integers(0, data.size - seq_len, size=batch_size)
    return np.stack([data[s:s + seq_len + 1] for s in starts]).astype(np.int32)


def test_batch_deterministic_and_real_slices(tree):
    root, _ = tree
    c = ByteCorpus(root, val_fraction=0.3)
    b = c.batch(5, 8, 31, seed=3)
    assert b.dtype == np.int32 and b.shape == (8, 32)
    assert np.array_equal(b, ref_batch(c.data, 5, 8, 31, 3))
    assert np.array_equal(b, c.batch(np.int64(5), 8, 31, seed=3))
    assert not np.array_equal(b, c.batch(6, 8, 31, seed=3))
    assert not np.array_equal(b, c.batch(5, 8, 31, seed=4))
    assert np.array_equal(c.batch_starts(5, 8, 31, seed=3),
                          np.random.default_rng([3, 5]).integers(0, c.num_bytes - 31, size=8))


def test_batch_window_bounds(tmp_path):
    c = small_corpus(tmp_path, bytes(range(1, 12)))            # N = 12 bytes with the separator
    assert c.num_bytes == 12
    starts = np.concatenate([c.batch_starts(s, 16, 10) for s in range(8)])
    assert set(starts.tolist()) == {0, 1}                       # windows of 11 bytes: starts 0 and N - 11 only
    assert np.array_equal(c.batch(0, 1, 11)[0], c.data.astype(np.int32))    # one window = the whole corpus
    with pytest.raises(ValueError, match=r"seq_len=12 needs windows of 13 bytes .* holds only 12 bytes"):
        c.batch(0, 1, 12)
    for name, kwargs in (("step", dict(step=-1)), ("seed", dict(seed=-2)), ("batch_size", dict(batch_size=0)),
                         ("seq_len", dict(seq_len=0)), ("batch_size", dict(batch_size=2.0))):
        args = dict(step=0, batch_size=2, seq_len=4, seed=0) | kwargs
        with pytest.raises(ValueError, match=rf"{name} must be an integer"):
            c.batch(**args)


def test_batches_iterator_matches_batch(tree):
    root, _ = tree
    c = ByteCorpus(root, val_fraction=0.3)
    with c.batches(4, 16, seed=7, start_step=3, prefetch=2) as it:
        got = [next(it) for _ in range(6)]
    assert [s for s, _ in got] == list(range(3, 9))
    for step, b in got:
        assert np.array_equal(b, ref_batch(c.data, step, 4, 16, 7))
    assert it.closed and not it._thread.is_alive()
    with pytest.raises(StopIteration):
        next(it)
    with pytest.raises(ValueError, match=r"prefetch must be an integer >= 1"):
        c.batches(4, 16, prefetch=0)
    with pytest.raises(ValueError, match=r"seq_len=100000 needs windows"):
        c.batches(4, 100_000)


def test_batches_thread_stops_when_dropped(tree):
    root, _ = tree
    it = ByteCorpus(root, val_fraction=0.3).batches(2, 8)
    next(it)
    thread = it._thread
    del it
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_batches_reraises_worker_error(tree, monkeypatch):
    root, _ = tree
    c = ByteCorpus(root, val_fraction=0.3)
    real = c.batch

    def failing(step, *args, **kwargs):
        if step == 2:
            raise RuntimeError("disk vanished at step 2")
        return real(step, *args, **kwargs)

    monkeypatch.setattr(c, "batch", failing)
    it = c.batches(2, 8, prefetch=1)
    assert [next(it)[0], next(it)[0]] == [0, 1]
    with pytest.raises(RuntimeError, match="disk vanished at step 2"):
        next(it)
    assert it.closed and not it._thread.is_alive()
    with pytest.raises(StopIteration):
        next(it)


def test_eval_batches_fixed_and_non_overlapping(tree):
    root, _ = tree
    c = ByteCorpus(root, "validation", val_fraction=0.3)
    evals = c.eval_batches(3, 20, num_batches=4)
    assert len(evals) == 4 and all(b.dtype == np.int32 and b.shape == (3, 21) for b in evals)
    assert all(np.array_equal(a, b) for a, b in zip(evals, c.eval_batches(3, 20, num_batches=4)))
    rows = np.concatenate(evals)
    # independent reference: 12 windows evenly spaced from 0, the last one as close to the end as the spacing allows
    stride = (c.num_bytes - 21) // 11
    assert stride >= 21
    for i, row in enumerate(rows):
        assert np.array_equal(row, c.data[i * stride:i * stride + 21])


def test_eval_batches_consecutive_when_tight(tmp_path):
    c = small_corpus(tmp_path, bytes(range(1, 24)))            # N = 24 = 2 batches x 3 rows x 4 bytes
    evals = c.eval_batches(3, 3, num_batches=2)
    assert np.array_equal(np.concatenate(evals).reshape(-1), c.data.astype(np.int32))
    with pytest.raises(ValueError, match=r"eval_batches needs 7 non-overlapping windows of 4 bytes .* holds 24"):
        c.eval_batches(7, 3, num_batches=1)
    with pytest.raises(ValueError, match=r"num_batches must be an integer >= 1"):
        c.eval_batches(1, 3, num_batches=0)


def test_local_rows():
    batch = np.arange(8 * 5).reshape(8, 5)
    parts = [local_rows(batch, i, 4) for i in range(4)]
    assert all(np.array_equal(p, batch[2 * i:2 * i + 2]) for i, p in enumerate(parts))
    assert np.array_equal(local_rows(batch, 0, 1), batch)
    with pytest.raises(ValueError, match=r"batch size 8 \(batch.shape\[0\]\) is not divisible by process_count=3"):
        local_rows(batch, 0, 3)
    with pytest.raises(ValueError, match=r"process_index must be in \[0, 4\), got 4"):
        local_rows(batch, 4, 4)
    with pytest.raises(ValueError, match=r"process_count must be an integer >= 1"):
        local_rows(batch, 0, 0)


# -- the real standard library ------------------------------------------------------------------------------------

def test_stdlib_default_corpus():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train = ByteCorpus(max_bytes=300_000)
    val = ByteCorpus(split="validation", max_bytes=300_000)
    assert train.root == stdlib and train.files and val.files
    assert not set(train.files) & set(val.files)
    assert all(ref_split(f, 0.05) == "train" for f in train.files)
    assert all(ref_split(f, 0.05) == "validation" for f in val.files)
    assert all(f.endswith(".py") and "site-packages" not in f.split("/") for f in train.files + val.files)
    assert train.num_bytes <= 300_000 and val.num_bytes <= 300_000
    assert train.data.tobytes() == b"".join((stdlib / f).read_bytes() + b"\x00" for f in train.files)
    # the first files of the split, in string order, from an independent listing
    listed = walk_listing(stdlib, ".py", ("site-packages", "dist-packages"))
    assert train.files == tuple(f for f in listed if ref_split(f, 0.05) == "train")[:len(train.files)]
    assert val.files == tuple(f for f in listed if ref_split(f, 0.05) == "validation")[:len(val.files)]
    assert all(corpus_mod.split_of(f, 0.05) == ref_split(f, 0.05) for f in listed)
