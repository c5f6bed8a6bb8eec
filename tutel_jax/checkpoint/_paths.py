"""Where a file named by a checkpoint may live: inside the checkpoint's own directory.

A checkpoint directory is untrusted input: its index (`model.safetensors.index.json`'s `weight_map`), and the
files other loaders read next to it (tokenizer, chat template), name further files by relative path. A name
such as `../../etc/passwd`, `/etc/passwd` or a symlink pointing elsewhere would make the loader read a file the
checkpoint's author chose anywhere on the machine. `resolve_inside` refuses those:

    shard = resolve_inside(model_dir, weight_map[name], f"{index}: weight_map shard")

Hugging Face cache snapshots keep working: `hf_hub_download` stores every file of a repository once under
`.../models--org--name/blobs/<hash>` and links it from `.../models--org--name/snapshots/<revision>/<file>`, so
the files of a snapshot are symlinks that leave the snapshot folder but stay inside the repository folder. When
the checkpoint directory is (or lies under) such a `snapshots/<revision>/` folder, a symlink whose resolved
target stays inside the `models--org--name` folder is accepted; any other escaping symlink is refused.
"""

from __future__ import annotations

import os
import pathlib

__all__ = ["resolve_inside", "hf_cache_repo"]

# Repository folder prefixes of the Hugging Face cache (`models--org--name`, datasets and spaces alike).
_HF_CACHE_PREFIXES = ("models--", "datasets--", "spaces--")


def hf_cache_repo(directory: str | os.PathLike) -> pathlib.Path | None:
    """The `<type>--org--name` repository folder when the resolved `directory` lies in a Hugging Face cache
    snapshot (`<repo>/snapshots/<revision>[/sub/folders]`), else None."""
    real = pathlib.Path(os.path.realpath(directory))
    parts = real.parts
    # the innermost `snapshots` folder with a revision below it and a cache repo folder above it
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith(_HF_CACHE_PREFIXES):
            return pathlib.Path(*parts[:i])
    return None


def _is_within(path: str, folder: str) -> bool:
    """Whether the resolved `path` is `folder` or lies below it (both already resolved)."""
    return os.path.commonpath([path, folder]) == folder


def resolve_inside(root: str | os.PathLike, name: str, what: str) -> pathlib.Path:
    """`root / name` once it is checked that the file a checkpoint names stays inside the checkpoint.

    Args:
      root: the checkpoint directory.
      name: the relative file name the checkpoint gives (e.g. a `weight_map` shard, 'tokenizer.json').
      what: what names the file, for the error (e.g. 'model.safetensors.index.json: weight_map shard').

    Returns the path `root / name` (not resolved: errors elsewhere keep naming the file as the checkpoint
    does). The file need not exist; callers check that.

    Raises ValueError naming `what` and `name` for: a name that is not a non-empty string, holds a NUL byte,
    is absolute (POSIX `/x`, Windows `C:\\x` or `\\\\server\\x`), or has a `..` component (with `/` or `\\` as
    separator); and for a name whose resolved path (symlinks followed) leaves `root`, except, in a Hugging Face
    cache snapshot, a symlink into the same cache repository folder (module docstring).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what}: file name must be a non-empty relative path string, got {name!r}")
    if "\x00" in name:
        raise ValueError(f"{what}: file name {name!r} contains a NUL byte")
    windows = pathlib.PureWindowsPath(name)
    if name.startswith(("/", "\\")) or windows.drive or windows.root:
        raise ValueError(f"{what}: file name {name!r} is absolute; a checkpoint may only name files inside "
                         "its own directory")
    if ".." in name.replace("\\", "/").split("/"):
        raise ValueError(f"{what}: file name {name!r} has a '..' component; a checkpoint may only name files "
                         "inside its own directory")
    path = pathlib.Path(root) / name
    real_root = os.path.realpath(root)
    target = os.path.realpath(path)
    if _is_within(target, real_root):
        return path
    repo = hf_cache_repo(real_root)
    if repo is not None and _is_within(target, str(repo)):
        return path  # a Hugging Face cache snapshot's link into the repository's blobs
    raise ValueError(f"{what}: file name {name!r} resolves to {target!r}, outside the checkpoint directory "
                     f"{real_root!r} (a symlink leaving the checkpoint is refused)")
