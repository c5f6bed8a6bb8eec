"""Placing a checkpoint's tensors on a device mesh as they are read.

`MeshPlacement(mesh, expert_axis)` is the `place(part, value, dtype)` callback of the loaders: routed-expert
weights (leading axis E) are split over `expert_axis`, and each device receives only its own experts through
`jax.make_array_from_callback` (the host slice is copied to that device alone); every other tensor is replicated.
Quantized containers are placed field by field (all fields lead with E). The model is read one layer at a
time, so neither the host nor any device holds the whole model's expert weights at once beyond their shards.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .. import quant

__all__ = ["MeshPlacement"]


def _host(value: Any, dtype: Any) -> np.ndarray:
    a = np.asarray(value)
    return a.astype(dtype) if np.issubdtype(a.dtype, np.floating) or a.dtype.name == "bfloat16" else a


@dataclasses.dataclass(frozen=True)
class MeshPlacement:
    """place(part, value, dtype) -> jax.Array on `mesh`; part 'experts' is sharded over `expert_axis`."""

    mesh: Mesh
    expert_axis: str = "expert"

    def __post_init__(self):
        if self.expert_axis not in self.mesh.axis_names:
            raise ValueError(f"expert_axis {self.expert_axis!r} is not an axis of the mesh {self.mesh.axis_names}")

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    @property
    def expert_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(self.expert_axis))

    def _sharded(self, a: np.ndarray) -> jax.Array:
        n = self.mesh.shape[self.expert_axis]
        if a.shape[0] % n:
            raise ValueError(f"{a.shape[0]} experts cannot be split over mesh axis {self.expert_axis!r} of size {n}")
        return jax.make_array_from_callback(a.shape, self.expert_sharding, lambda index: a[index])

    def __call__(self, part: str, value: Any, dtype: Any) -> Any:
        if quant.is_quantized(value):  # packed fields keep their dtypes
            put = self._sharded if part == "experts" else (lambda a: jax.device_put(a, self.replicated))
            return jax.tree_util.tree_map(lambda a: put(np.asarray(a)), value)
        a = _host(value, dtype)
        return self._sharded(a) if part == "experts" else jax.device_put(a, self.replicated)
