"""Tutel state dicts <-> tutel-jax parameter pytrees.

Parameter pytrees are named like Tutel's modules, so a state-dict key is the pytree path joined with '.':
`gates.0.wg.weight`, `experts.batched_fc1_w`, ... plus `_num_global_experts` (int64 scalar).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import jax
import numpy as np

from ._torch_zip import load_torch_file

__all__ = ["params_to_state_dict", "state_dict_to_params", "read_state_dict", "find_layer_prefix",
           "NUM_EXPERTS_KEY"]

NUM_EXPERTS_KEY = "_num_global_experts"


def _path_key(path) -> str:
    parts = []
    for entry in path:
        if isinstance(entry, jax.tree_util.DictKey):
            parts.append(str(entry.key))
        elif isinstance(entry, jax.tree_util.SequenceKey):
            parts.append(str(entry.idx))
        else:
            parts.append(str(getattr(entry, "name", entry)))
    return ".".join(parts)


def params_to_state_dict(params: Any, num_global_experts: int, prefix: str = "") -> dict[str, np.ndarray]:
    """Flattens a parameter pytree into Tutel's state-dict keys (NumPy arrays, host memory)."""
    state = {prefix + NUM_EXPERTS_KEY: np.asarray(num_global_experts, np.int64)}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        state[prefix + _path_key(path)] = np.asarray(jax.device_get(leaf))
    return state


def find_layer_prefix(keys: Any) -> str:
    """The prefix of the MoE layer inside a larger model's state dict (e.g. '_moe_layer.'), found from the
    unique key ending in `_num_global_experts`."""
    keys = list(keys)
    if NUM_EXPERTS_KEY in keys:
        return ""
    hits = [k for k in keys if k.endswith("." + NUM_EXPERTS_KEY)]
    if len(hits) == 1:
        return hits[0][: -len(NUM_EXPERTS_KEY)]
    if not hits:
        raise ValueError(f"not a Tutel MoE state dict: no '{NUM_EXPERTS_KEY}' key among {sorted(keys)[:8]}...")
    raise ValueError(f"several MoE layers in this state dict ({[h[:-len(NUM_EXPERTS_KEY)] for h in hits]}); "
                     "pass prefix= to choose one")


def read_state_dict(source: str | os.PathLike | Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A state dict from a Tutel `torch.save` file (read without torch) or from a mapping of arrays."""
    if isinstance(source, (str, os.PathLike)):
        return load_torch_file(source)
    if not isinstance(source, Mapping):
        raise ValueError(f"expected a checkpoint path or a mapping of arrays, got {type(source).__name__}")
    return {str(k): np.asarray(v.detach().cpu().numpy() if hasattr(v, "detach") else v) for k, v in source.items()}


def state_dict_to_params(state: Mapping[str, np.ndarray], template: Any, num_global_experts: int,
                         prefix: str | None = None) -> Any:
    """Fills a parameter pytree shaped like `template` from a Tutel state dict.

    Every template leaf must be present with the template's shape; the expert count must match; keys that the
    layer does not have are refused. Values are cast to the template's dtypes.
    """
    if prefix is None:
        prefix = find_layer_prefix(state.keys())
    layer_keys = {k[len(prefix):]: k for k in state if k.startswith(prefix)}
    if NUM_EXPERTS_KEY in layer_keys:
        stored = np.asarray(state[layer_keys[NUM_EXPERTS_KEY]])
        if stored.shape != () or int(stored) != num_global_experts:
            raise ValueError(f"checkpoint has {stored.tolist()} global experts ('{prefix}{NUM_EXPERTS_KEY}'), "
                             f"this layer has {num_global_experts}")
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(template)
    expected = {_path_key(p) for p, _ in leaves_with_path}
    missing = sorted(expected - set(layer_keys))
    if missing:
        raise ValueError(f"checkpoint is missing key(s) {[prefix + m for m in missing]}")
    unexpected = sorted(set(layer_keys) - expected - {NUM_EXPERTS_KEY})
    if unexpected:
        raise ValueError(f"checkpoint has key(s) this layer does not have: {[prefix + u for u in unexpected]}")
    leaves = []
    for path, leaf in leaves_with_path:
        key = _path_key(path)
        value = np.asarray(state[layer_keys[key]])
        if tuple(value.shape) != tuple(leaf.shape):
            raise ValueError(f"checkpoint tensor '{prefix}{key}' has shape {list(value.shape)}, "
                             f"this layer expects {list(leaf.shape)}")
        leaves.append(value.astype(leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)
