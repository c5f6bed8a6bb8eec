"""Tutel's per-rank checkpoints: one ``torch.save`` file per expert-parallel rank, gathered and scattered.

A Tutel job with W ranks saves one file per rank from a path pattern holding ``{rank}`` and ``{size}``
(``/ckpt/moe-{rank}-of-{size}.pt``). Each file holds, for every MoE layer (prefix ``P``, possibly empty):

* ``P_num_global_experts``: int64 scalar E, the same in every file;
* the rank's *local* expert tensors ``P experts.*`` (``experts.batched_fc1_w`` ...), global shape [E, *S]:

  - E % W == 0 (n = E / W experts per rank): rank r holds experts r*n .. r*n+n-1, shape [n, *S];
  - W % E == 0 (s = W / E ranks share one expert): rank r holds chunk j = r % s of expert r // s, taken from
    the expert's tensor flattened and zero-padded to a multiple of s. The chunk keeps the leading rows when
    they split evenly (fc1/fc2 weights [E, H, M] -> [1, H/s, M]) and is flat otherwise (fc2 bias [E, M] ->
    [1, ceil(M/s)]);
* every other tensor (gates ``gates.0.wg.weight`` [E, M], non-MoE parameters) replicated as is.

:func:`gather_state_dicts` turns the W files' state dicts into one single-rank state dict with all E experts
(global shapes, padding dropped) and :func:`scatter_state_dict` is its exact inverse, like Tutel's
``tutel.checkpoint.gather`` / ``tutel.checkpoint.scatter`` (the CLI is ``python -m tutel_jax.checkpoint``).
:func:`save_tutel_rank_files` / :func:`load_tutel_rank_files` do the file I/O (each file written
atomically, files read without torch), :func:`load_tutel_rank_files_as_params` goes straight to a global
parameter pytree.

Expert tensors are those under ``P + 'experts.'`` for a layer prefix ``P`` found from a
``P_num_global_experts`` key, so models with several MoE layers (even with different E) work.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ._torch_zip import load_torch_file, save_torch_file
from ._tutel_format import NUM_EXPERTS_KEY, params_to_state_dict, state_dict_to_params
from ..validation import check_int

__all__ = [
    "rank_path",
    "gather_state_dicts",
    "scatter_state_dict",
    "save_tutel_rank_files",
    "save_tutel_state_dict_rank_files",
    "load_tutel_rank_files",
    "load_tutel_rank_files_as_params",
]

_EXPERTS = "experts."
# A flat (1-D per expert) chunked tensor whose true length is the last dim of a sibling tensor:
# Tutel pads fc2's bias [E, M_out] to a multiple of s; M_out is fc2's weight [E, H, M_out] last dim.
_LENGTH_FROM_SIBLING = {"batched_fc2_bias": "batched_fc2_w"}


# --------------------------------------------------------------------------
# Paths
# --------------------------------------------------------------------------


def rank_path(pattern: str | os.PathLike[str], rank: int, size: int) -> str:
    """The file of ``rank`` out of ``size``: ``pattern`` with ``{rank}`` and ``{size}`` substituted.

    Like Tutel's ``system.apply_rank_size_from_pattern`` (plain text substitution, other braces kept).

    Raises:
        ValueError: ``rank`` is not in [0, size), or ``size > 1`` and the pattern has no ``{rank}`` (every
            rank would read or write the same file).
    """
    pattern = os.fspath(pattern)
    _check_size(size, "size")
    check_int(rank, "rank", minimum=0, maximum=size - 1)
    if size > 1 and "{rank}" not in pattern:
        raise ValueError(f"file pattern {pattern!r} has no '{{rank}}': all {size} ranks would use the same file")
    return pattern.replace("{rank}", str(rank)).replace("{size}", str(size))


def _check_size(size: Any, what: str) -> int:
    check_int(size, what, minimum=1)
    return int(size)


# --------------------------------------------------------------------------
# Layers and expert keys
# --------------------------------------------------------------------------


def _layer_experts(state: Mapping[str, Any], where: str) -> dict[str, int]:
    """``{layer prefix: E}`` for every ``<prefix>_num_global_experts`` key (prefix '' or ending in '.')."""
    layers = {}
    for key, value in state.items():
        if key == NUM_EXPERTS_KEY or key.endswith("." + NUM_EXPERTS_KEY):
            value = np.asarray(value)
            if value.shape != () or value.dtype.kind not in "iu" or int(value) < 1:
                raise ValueError(f"{where}: '{key}' must be a positive integer scalar, got {value.tolist()!r}")
            layers[key[: -len(NUM_EXPERTS_KEY)]] = int(value)
    if not layers:
        raise ValueError(f"{where}: no Tutel MoE layer found (no '{NUM_EXPERTS_KEY}' key among "
                         f"{sorted(state)[:8]}...)")
    return layers


def _expert_layer(key: str, layers: Mapping[str, int]) -> str | None:
    """The prefix of the layer whose ``experts.`` tensor ``key`` is (the longest match), or None."""
    matches = [p for p in layers if key.startswith(p + _EXPERTS)]
    return max(matches, key=len) if matches else None


def _expert_keys(state: Mapping[str, Any], layers: Mapping[str, int], where: str) -> dict[str, str]:
    """``{expert tensor key: layer prefix}``; refuses ``experts.`` tensors that belong to no layer."""
    owned = {}
    for key in state:
        prefix = _expert_layer(key, layers)
        if prefix is not None:
            owned[key] = prefix
        elif key.startswith(_EXPERTS) or ("." + _EXPERTS) in key:
            raise ValueError(f"{where}: '{key}' looks like an expert tensor but no matching "
                             f"'{NUM_EXPERTS_KEY}' key says how many experts its layer has")
    return owned


def _split_mode(num_experts: int, size: int, key: str) -> str:
    """'slice' when E % N == 0 (n = E/N experts per rank), 'shard' when N % E == 0 (s = N/E ranks each)."""
    if num_experts % size == 0:
        return "slice"
    if size % num_experts == 0:
        return "shard"
    raise ValueError(f"cannot split E={num_experts} experts over N={size} ranks for '{key}': "
                     f"neither E % N == 0 nor N % E == 0")


# --------------------------------------------------------------------------
# Scatter
# --------------------------------------------------------------------------


def _true_length(key: str, state: Mapping[str, Any]) -> int | None:
    """The per-expert length of a 1-D-per-expert tensor that gather can recover from a sibling, if any."""
    head, _, name = key.rpartition(".")
    sibling = _LENGTH_FROM_SIBLING.get(name)
    if sibling is None:
        return None
    other = state.get(f"{head}.{sibling}")
    return None if other is None or np.ndim(other) < 2 else int(np.shape(other)[-1])


def _chunk_shape(key: str, per_expert: tuple[int, ...], s: int, state: Mapping[str, Any]) -> tuple[int, ...]:
    """Shape [1, ...] of one rank's 1/s chunk of one expert's tensor of shape ``per_expert`` (= [*S]).

    Refuses tensors whose chunks gather could not reassemble exactly.
    """
    if len(per_expert) >= 2 and per_expert[0] % s == 0:
        return (1, per_expert[0] // s) + per_expert[1:]
    if len(per_expert) == 1:
        length, true_length = per_expert[0], _true_length(key, state)
        if true_length is not None and true_length != length:
            raise ValueError(f"'{key}' has {length} values per expert but its sibling tensor says {true_length}")
        if length % s == 0 or true_length == length:
            return (1, -(-length // s))
        raise ValueError(f"'{key}': a per-expert length {length} is not divisible by {s} ranks per expert, and "
                         f"its true length could not be recovered after padding")
    raise ValueError(f"'{key}' of per-expert shape {list(per_expert)} cannot be split over {s} ranks per "
                     f"expert: its first per-expert dimension must be divisible by {s}")


def _shard_pieces(key: str, value: np.ndarray, s: int, state: Mapping[str, Any]) -> list[np.ndarray]:
    """[E, *S] -> E*s chunks: chunk r = flat chunk r % s of expert r // s (zero-padded to a multiple of s)."""
    num_experts = value.shape[0]
    shape = _chunk_shape(key, tuple(value.shape[1:]), s, state)
    flat = value.reshape(num_experts, -1)
    chunk = -(-flat.shape[1] // s)
    pad = chunk * s - flat.shape[1]
    if pad:
        flat = np.concatenate([flat, np.zeros((num_experts, pad), flat.dtype)], axis=1)
    rows = flat.reshape(num_experts * s, chunk)
    return [rows[r].reshape(shape).copy() for r in range(num_experts * s)]


def _split_expert_tensor(key: str, value: np.ndarray, num_experts: int, size: int,
                         state: Mapping[str, Any]) -> list[np.ndarray]:
    """One expert tensor [E, *S] -> N per-rank pieces."""
    if value.ndim < 1 or value.shape[0] != num_experts:
        raise ValueError(f"'{key}' has shape {list(value.shape)}; an expert tensor of a layer with "
                         f"{num_experts} experts must have {num_experts} rows")
    if _split_mode(num_experts, size, key) == "slice":
        n = num_experts // size
        return [value[r * n:(r + 1) * n].copy() for r in range(size)]
    return _shard_pieces(key, value, size // num_experts, state)


def scatter_state_dict(state: Mapping[str, Any], size: int) -> list[dict[str, np.ndarray]]:
    """Splits a single-rank Tutel state dict (all E experts) into N per-rank state dicts.

    Args:
        state: keys to arrays; expert tensors [E, *S] under ``<layer>experts.``; ``<layer>_num_global_experts``.
        size: N, the number of ranks. Each layer needs E % N == 0 (rank r gets experts r*E/N .. as [E/N, *S])
            or N % E == 0 (rank r gets the flat chunk r % s of expert r // s, s = N / E; shapes in the module
            docstring).

    Returns:
        N dicts in ``state``'s key order; replicated tensors are shared (not copied) between them.

    Raises:
        ValueError: no MoE layer, an expert tensor without E rows, E and N incompatible (names both), or a
            tensor whose sharded chunks could not be reassembled exactly.
    """
    size = _check_size(size, "size")
    state = {str(k): np.asarray(v) for k, v in state.items()}
    layers = _layer_experts(state, "state dict")
    owned = _expert_keys(state, layers, "state dict")
    pieces = {k: _split_expert_tensor(k, state[k], layers[p], size, state) for k, p in owned.items()}
    return [{k: pieces[k][r] if k in pieces else v for k, v in state.items()} for r in range(size)]


# --------------------------------------------------------------------------
# Gather
# --------------------------------------------------------------------------


def _check_same_layout(states: Sequence[Mapping[str, np.ndarray]], names: Sequence[str]) -> None:
    """Same keys, `_num_global_experts`, shapes and dtypes in every rank's state dict as in rank 0's."""
    first = states[0]
    for rank, state in enumerate(states[1:], 1):
        missing, extra = sorted(set(first) - set(state)), sorted(set(state) - set(first))
        if missing or extra:
            raise ValueError(f"{names[rank]} does not have the same keys as {names[0]}: "
                             f"missing {missing}, extra {extra}")
        for key, value in state.items():
            ref = first[key]
            if key == NUM_EXPERTS_KEY or key.endswith("." + NUM_EXPERTS_KEY):
                if value.tolist() != ref.tolist():
                    raise ValueError(f"inconsistent '{key}': {ref.tolist()} in {names[0]} but {value.tolist()} "
                                     f"in {names[rank]}")
            elif value.shape != ref.shape or value.dtype != ref.dtype:
                raise ValueError(f"'{key}' has shape {list(value.shape)} ({value.dtype}) in {names[rank]} but "
                                 f"{list(ref.shape)} ({ref.dtype}) in {names[0]}")


def _unshard(key: str, pieces: Sequence[np.ndarray], num_experts: int, length: int | None) -> np.ndarray:
    """N = E*s chunks [1, *T] -> [E, *S]: concatenate each expert's s flat chunks, drop the padding."""
    chunk_shape = pieces[0].shape
    if len(chunk_shape) < 2 or chunk_shape[0] != 1:
        raise ValueError(f"'{key}': a rank's chunk of a shared expert must have shape [1, ...], "
                         f"got {list(chunk_shape)}")
    s = len(pieces) // num_experts
    flat = np.stack([p.reshape(-1) for p in pieces]).reshape(num_experts, -1)  # [E, s * chunk]
    if len(chunk_shape) >= 3:
        return flat.reshape((num_experts, chunk_shape[1] * s) + chunk_shape[2:])
    if length is None:
        return flat
    if not flat.shape[1] - s < length <= flat.shape[1]:
        raise ValueError(f"'{key}': {s} chunks of {chunk_shape[1]} cannot hold a padded length of {length}")
    return np.ascontiguousarray(flat[:, :length])


def _gather_expert_tensor(key: str, pieces: Sequence[np.ndarray], num_experts: int,
                          length: int | None) -> np.ndarray:
    """N per-rank pieces -> [E, *S]; ``length``: the true per-expert length of a padded flat tensor."""
    size = len(pieces)
    if _split_mode(num_experts, size, key) == "slice":
        rows = pieces[0].shape[0] if pieces[0].ndim else 0
        if rows * size != num_experts:
            raise ValueError(f"'{key}': each of the {size} rank files holds {rows} experts (shape "
                             f"{list(pieces[0].shape)}), but the layer has E={num_experts} = {size} x "
                             f"{num_experts // size}; is the number of ranks right?")
        return np.concatenate(pieces, axis=0)
    return _unshard(key, pieces, num_experts, length)


def gather_state_dicts(states: Sequence[Mapping[str, Any]],
                       names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Merges N per-rank Tutel state dicts into one single-rank state dict with all E experts.

    Exact inverse of :func:`scatter_state_dict` (bitwise; the padding of flat chunks is dropped).

    Args:
        states: rank 0 .. N-1's state dicts, each with that rank's local experts (module docstring).
        names: labels of the ranks for error messages (e.g. file paths); default 'rank 0', ...

    Returns:
        Rank 0's keys in rank 0's order: expert tensors [E, *S] (concatenated along dim 0, or reassembled from
        flat chunks when N % E == 0), replicated tensors from rank 0 (other ranks' values are not compared).

    Raises:
        ValueError: no states, no MoE layer, different keys / `_num_global_experts` / shapes / dtypes between
            ranks, E and N incompatible, or pieces that do not add up to E experts.
    """
    if not states:
        raise ValueError("gather_state_dicts needs at least one rank's state dict")
    states = [{str(k): np.asarray(v) for k, v in s.items()} for s in states]
    names = list(names) if names is not None else [f"rank {r}" for r in range(len(states))]
    if len(names) != len(states):
        raise ValueError(f"got {len(names)} names for {len(states)} state dicts")
    layers = _layer_experts(states[0], names[0])
    _check_same_layout(states, names)
    owned = _expert_keys(states[0], layers, names[0])
    # Unpadded tensors first, so padded 1-D ones can read their true length from gathered siblings.
    gathered: dict[str, np.ndarray] = {}
    for key in sorted(owned, key=lambda k: states[0][k].ndim == 2):
        pieces = [s[key] for s in states]
        gathered[key] = _gather_expert_tensor(key, pieces, layers[owned[key]], _true_length(key, gathered))
    return {k: gathered.get(k, v) for k, v in states[0].items()}


# --------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------


def _rank_paths(pattern: str | os.PathLike[str], size: int) -> list[str]:
    size = _check_size(size, "world_size")
    return [rank_path(pattern, r, size) for r in range(size)]


def save_tutel_state_dict_rank_files(state: Mapping[str, Any], pattern: str | os.PathLike[str],
                                     world_size: int) -> list[str]:
    """Scatters a full state dict and writes one ``torch.save`` file per rank (each atomically).

    Parent folders are created (as Tutel does). The set of files is not written atomically as a whole: a crash
    part-way can leave some ranks' files new and others old.

    Returns:
        The N file paths, rank order.
    """
    paths = _rank_paths(pattern, world_size)
    parts = scatter_state_dict(state, world_size)  # validates everything before any file is touched
    for path, part in zip(paths, parts):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_torch_file(path, part)
    return paths


def save_tutel_rank_files(params: Any, num_global_experts: int, pattern: str | os.PathLike[str],
                          world_size: int, prefix: str = "") -> list[str]:
    """Writes a global parameter pytree as W Tutel per-rank files (what a W-rank Tutel job would save).

    Args:
        params: ``{'gates': [...], 'experts': {...}}`` with global expert tensors [E, ...] (sharded
            ``jax.Array``s are fetched to the host; single-process only).
        num_global_experts: E.
        pattern: path with ``{rank}`` (and optionally ``{size}``), e.g. ``/ckpt/moe-{rank}-of-{size}.pt``.
        world_size: W; E % W == 0 or W % E == 0.
        prefix: key prefix of the layer (e.g. ``'_moe_layer.'``).

    Returns:
        The W file paths, rank order.
    """
    return save_tutel_state_dict_rank_files(params_to_state_dict(params, num_global_experts, prefix),
                                            pattern, world_size)


def load_tutel_rank_files(pattern: str | os.PathLike[str], world_size: int) -> dict[str, np.ndarray]:
    """Reads W per-rank ``torch.save`` files (without torch) and gathers them into one full state dict.

    Raises:
        FileNotFoundError: some rank files do not exist (all missing paths are named).
        ValueError: unreadable files (``CheckpointFormatError``) or inconsistent ranks (see
            :func:`gather_state_dicts`).
    """
    paths = _rank_paths(pattern, world_size)
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(f"missing rank file(s) for pattern {os.fspath(pattern)!r} with size {world_size}: "
                                f"{', '.join(missing)}")
    return gather_state_dicts([load_torch_file(p) for p in paths], names=paths)


def load_tutel_rank_files_as_params(pattern: str | os.PathLike[str], world_size: int, template: Any,
                                    num_global_experts: int, prefix: str | None = None) -> Any:
    """Per-rank files -> a global parameter pytree shaped like ``template`` (e.g. ``init_params(config)``).

    The result holds host NumPy arrays; place them with ``shard_params`` for expert parallelism on any
    mesh whose expert-axis size divides E.
    """
    state = load_tutel_rank_files(pattern, world_size)
    return state_dict_to_params(state, template, num_global_experts, prefix)
