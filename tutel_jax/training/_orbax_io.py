"""Training-state checkpoints with Orbax: save sharded on one mesh, restore onto any other.

A *training state* is any pytree of arrays, typically::

    {'params': {'gates': [...], 'experts': {'batched_fc1_w': [E, H, M], ...}},   # experts split on dim 0
     'opt_state': optax_state,                                                   # e.g. adam's mu / nu like params
     'step': int32 scalar}

Leaves may be ``jax.Array``s sharded on any mesh (expert tensors split over the expert axes, others
replicated), NumPy arrays or scalars. Orbax stores every array as one global tensor (tensorstore), so the layout
at save time does not matter when restoring: the caller says, per leaf, which sharding it wants (e.g. the
8-device EP layout, a 4-device mesh holding 2 experts per device, or one device).

Layout on disk: ``<directory>/<step>/`` per checkpoint. A save writes ``<step>.orbax-checkpoint-tmp-<time>/``
and renames it to ``<step>/`` only when complete (Orbax's atomic-rename protocol on local file systems), so a
process killed mid-save leaves at most a temporary folder that is never listed as a step; it is removed by the
next :func:`save_checkpoint` into the same directory. Saves are synchronous (the function returns once the step
is committed). Single-process (one host) use; multi-host needs every process to call in step, as Orbax requires.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from ..validation import check_int

__all__ = ["save_checkpoint", "restore_checkpoint", "latest_step", "all_steps"]


def _abs_dir(directory: str | os.PathLike[str]) -> Path:
    """Orbax wants absolute paths; relative ones are taken from the current directory."""
    return Path(os.path.abspath(os.fspath(directory)))


def _manager(directory: Path, *, read_only: bool, max_to_keep: int | None = None) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        read_only=read_only,
        create=not read_only,
        max_to_keep=max_to_keep,
        enable_async_checkpointing=False,  # save() returns once the step directory is committed
        cleanup_tmp_directories=not read_only,  # remove leftovers of killed saves
    )
    return ocp.CheckpointManager(directory, item_handlers=ocp.StandardCheckpointHandler(), options=options)


def _check_step(step: Any) -> int:
    return check_int(step, "step", minimum=0)


def save_checkpoint(directory: str | os.PathLike[str], state: Any, step: int, *,
                    max_to_keep: int | None = None) -> Path:
    """Saves ``state`` (a pytree of arrays, possibly sharded) as step ``step`` under ``directory``, atomically.

    Args:
        directory: the checkpoint root (created if missing; relative paths are made absolute).
        state: pytree of ``jax.Array`` / NumPy arrays / Python scalars; optax states (namedtuples) are fine.
        step: the step number; it must not already exist in ``directory``.
        max_to_keep: keep only this many newest steps (older ones are deleted after the save); None keeps all.

    Returns:
        The committed step directory ``<directory>/<step>``.

    Raises:
        ValueError: a negative or non-integer step, or the step already exists.
    """
    root = _abs_dir(directory)
    step = _check_step(step)
    with _manager(root, read_only=False, max_to_keep=max_to_keep) as manager:
        if step in manager.all_steps():
            raise ValueError(f"checkpoint step {step} already exists in {root}")
        manager.save(step, args=ocp.args.StandardSave(state), force=True)
        manager.wait_until_finished()
    return root / str(step)


def all_steps(directory: str | os.PathLike[str]) -> list[int]:
    """Committed steps under ``directory``, ascending (temporary folders of unfinished saves are ignored)."""
    root = _abs_dir(directory)
    if not root.is_dir():
        return []
    with _manager(root, read_only=True) as manager:
        return sorted(manager.all_steps())


def latest_step(directory: str | os.PathLike[str]) -> int | None:
    """The newest committed step under ``directory``, or None when there is none."""
    steps = all_steps(directory)
    return steps[-1] if steps else None


def _path_key(path: tuple) -> tuple[str, ...]:
    """A key path with namedtuple fields / dict keys / indices as strings, as Orbax names stored leaves."""
    parts = []
    for entry in path:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                parts.append(str(getattr(entry, attr)))
                break
        else:
            parts.append(str(entry))
    return tuple(parts)


def _stored_arrays(manager: ocp.CheckpointManager, step: int) -> dict[tuple[str, ...], Any]:
    """``{key path: ArrayMetadata (shape, dtype)}`` of the arrays stored at ``step``."""
    metadata = manager.item_metadata(step)
    return {_path_key(p): m for p, m in jax.tree_util.tree_flatten_with_path(metadata.tree)[0]}


def _abstract_from_shardings(shardings: Any, stored: dict[tuple[str, ...], Any], where: Path) -> Any:
    """A pytree of ``jax.sharding.Sharding`` -> ShapeDtypeStructs with the stored shapes and dtypes."""

    def leaf(path, sharding):
        meta = stored.get(_path_key(path))
        if meta is None:
            raise ValueError(f"{where} has no array at {'/'.join(_path_key(path))}; stored: "
                             f"{sorted('/'.join(k) for k in stored)[:8]}...")
        return jax.ShapeDtypeStruct(meta.shape, meta.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(leaf, shardings)


def _check_against_stored(abstract: Any, stored: dict[tuple[str, ...], Any], where: Path) -> None:
    """Same leaves and global shapes as stored (Orbax's own errors here are noisy, and padding is never wanted)."""
    wanted = {_path_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    missing, extra = sorted(set(wanted) - set(stored)), sorted(set(stored) - set(wanted))
    if missing or extra:
        raise ValueError(f"target does not match the arrays stored in {where}: not stored "
                         f"{['/'.join(k) for k in missing]}, not in target {['/'.join(k) for k in extra]}")
    for key, x in wanted.items():
        shape, stored_shape = getattr(x, "shape", None), getattr(stored[key], "shape", None)
        if shape is not None and stored_shape is not None and tuple(shape) != tuple(stored_shape):
            raise ValueError(f"target shape {list(x.shape)} for '{'/'.join(key)}' differs from the stored global "
                             f"shape {list(stored[key].shape)} in {where}")


def _as_abstract(target: Any, stored: dict[tuple[str, ...], Any], where: Path) -> Any:
    """Target pytree -> abstract state: ShapeDtypeStructs as given, arrays' shape / dtype / sharding, or
    shardings combined with the stored shapes and dtypes."""
    leaves = jax.tree.leaves(target)
    if leaves and all(isinstance(x, jax.sharding.Sharding) for x in leaves):
        abstract = _abstract_from_shardings(target, stored, where)
    elif any(isinstance(x, jax.sharding.Sharding) for x in leaves):
        raise ValueError("target must be all shardings or all arrays / jax.ShapeDtypeStructs, not a mix")
    else:  # a NumPy scalar (which save accepts) is described as its 0-d array; Orbax has no rule for it
        abstract = jax.tree.map(lambda x: ocp.utils.to_shape_dtype_struct(np.asarray(x) if isinstance(x, np.generic)
                                                                         else x), target)
    _check_against_stored(abstract, stored, where)
    return abstract


def _like_target(target: Any, restored: Any) -> Any:
    """NumPy-scalar leaves of ``target`` come back as that scalar type (restored as 0-d arrays)."""
    return jax.tree.map(lambda t, r: type(t)(np.asarray(r)) if isinstance(t, np.generic) else r, target, restored)


def restore_checkpoint(directory: str | os.PathLike[str], target: Any, step: int | None = None) -> Any:
    """Restores a step saved by :func:`save_checkpoint` onto the caller's shardings (any mesh).

    Args:
        directory: the checkpoint root.
        target: the state's structure and placement, as one of
            * an abstract state: a pytree of ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` (e.g. from
              ``jax.eval_shape`` plus the shardings of the new mesh); dtypes other than the stored ones are cast;
            * a pytree of arrays shaped like the state (their shapes, dtypes and shardings are used);
            * a pytree of ``jax.sharding.Sharding`` with the state's structure (shapes and dtypes as stored).
            Shapes must equal the stored global shapes; the shardings may be on any devices / mesh. A
            ShapeDtypeStruct without a sharding gets the stored one, which needs the saving job's devices.
        step: which step; default the latest.

    Returns:
        The state with ``target``'s pytree structure (optax namedtuples included): a ``jax.Array`` with the
        requested sharding for every ShapeDtypeStruct / ``jax.Array`` / Sharding leaf of ``target``; NumPy arrays
        and Python scalars where ``target`` has those.

    Raises:
        FileNotFoundError: no committed checkpoint (or not this step) under ``directory``.
        ValueError: ``target`` has other leaves or global shapes than the stored tree.
    """
    root = _abs_dir(directory)
    steps = all_steps(root)
    if step is None:
        if not steps:
            raise FileNotFoundError(f"no committed checkpoint under {root}")
        step = steps[-1]
    step = _check_step(step)
    if step not in steps:
        raise FileNotFoundError(f"no committed checkpoint step {step} under {root} (steps: {steps})")
    with _manager(root, read_only=True) as manager:
        abstract = _as_abstract(target, _stored_arrays(manager, step), root / str(step))
        try:
            return _like_target(target, manager.restore(step, args=ocp.args.StandardRestore(abstract)))
        except ValueError as exc:
            raise ValueError(f"cannot restore {root / str(step)} onto the given target: {exc}") from exc
