"""Weights kept quantized in memory (FP8 block, MXFP4, NVFP4, per-channel int8 / FP8): the containers and the dense
matmul.

A quantized weight is one of `pallas_kernels.quant`'s containers (`Fp8BlockWeight`, `Mxfp4Weight`,
`Nvfp4Weight`, `Int8Weight`, `Fp8ChannelWeight`), a pytree of its packed arrays in the HF layout [..., out, in].

  dense(x [..., in], w [out, in]) -> [..., out]   (attention / dense MLP / shared-expert projections)

The MoE experts' matmuls over [E, out, in] containers (batched, grouped, gathered) are the grouped-linear
primitive, `tutel_jax.experts._grouped_linear`, which takes float and packed expert weights alike.

`implementation` follows `pallas_kernels`: "auto" runs the dequantizing Pallas kernel on a GPU and the XLA
reference (dequantize in float32, then matmul) elsewhere; "xla", "pallas" or "interpret" force one. Plain
arrays go through the same functions as ordinary matmuls, so callers need not branch. Quantized weights are
for inference: the kernels have no VJP.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import quant_matmul
from pallas_kernels.quant import FORMATS as _FORMAT_RECORDS
from pallas_kernels.quant import format_of

from ..core import empty_aligned

__all__ = ["FORMATS", "is_quantized", "check_format", "dense", "dequantize", "quantize", "to_jax", "stack",
           "logical_shape", "resident_bytes"]

#: the packed weight formats' names (`pallas_kernels.quant.formats`, one module each)
FORMATS = tuple(_FORMAT_RECORDS)


def is_quantized(w: Any) -> bool:
    """True for a quantized-weight container (one of the formats' containers)."""
    return format_of(w) is not None


def check_format(weight_format: str | None, what: str = "weight_format") -> str | None:
    if weight_format is not None and weight_format not in FORMATS:
        raise ValueError(f"{what} must be None or one of {FORMATS}, got {weight_format!r}")
    return weight_format


def _impl(implementation: str | None) -> str:
    return "auto" if implementation is None else implementation


def dense(x: jax.Array, w: Any, implementation: str | None = "auto") -> jax.Array:
    """x [..., in] @ w[out, in].T -> [..., out] in x's dtype; w a plain array or a quantized container."""
    if not is_quantized(w):
        return jnp.einsum("...i,oi->...o", x, w.astype(x.dtype))
    lead = x.shape[:-1]
    y = quant_matmul(x.reshape(-1, x.shape[-1]), w, out_dtype=x.dtype, implementation=_impl(implementation))
    return y.reshape(*lead, y.shape[-1])


def dequantize(w: Any, dtype: Any = jnp.float32) -> jax.Array:
    """The float tensor [..., out, in] a container stands for (exact float32 values, then cast)."""
    return w.dequantize().astype(dtype) if is_quantized(w) else jnp.asarray(w, dtype)


def quantize(w: jax.Array, weight_format: str) -> Any:
    """float w [..., out, in] -> the container of `weight_format` (round to nearest; for tests and random init)."""
    check_format(weight_format)
    return _FORMAT_RECORDS[weight_format].quantize(w)


def to_jax(a: Any, dtype: Any) -> Any:
    """A checkpoint value on the default device: arrays cast to `dtype`, containers with their packed dtypes."""
    # device_put: no copy of an aligned host array on CPU (`host_memory`), one copy otherwise (jnp.asarray would
    # make a second, transient one)
    if is_quantized(a):
        return jax.tree_util.tree_map(jax.device_put, a)
    if isinstance(a, np.ndarray) and a.dtype == np.dtype(dtype):
        return jax.device_put(a)
    return jnp.asarray(a, dtype)


def stack(values: Iterable[Any], count: int, what: str = "experts") -> Any:
    """Stacks `count` per-expert arrays, or per-expert containers field by field, on a new leading axis: NumPy
    arrays [count, ...] from `empty_aligned` (see `host_memory`). `values` is consumed one at a time and each value
    is dropped once copied into its slot, so a lazy iterable (e.g. tensors read from a checkpoint) holds the
    stacked result plus one expert at a time, never a layer's experts twice. ValueError (naming `what` and the
    expert) for values of different formats, structures, shapes or dtypes, or not `count` of them."""
    treedef, outs, n = None, [], 0
    for i, value in enumerate(values):
        leaves, tree = jax.tree_util.tree_flatten(value)
        if treedef is None:
            treedef = tree
            outs = [empty_aligned((count,) + np.shape(leaf), np.asarray(leaf).dtype) for leaf in leaves]
        if tree != treedef:
            raise ValueError(f"{what}: expert {i} is {getattr(value, 'format', None) or 'float'}, unlike expert 0 "
                             "(mixed weight formats)")
        if i >= count:
            raise ValueError(f"{what}: more than {count} experts")
        for out, leaf in zip(outs, leaves):
            leaf = np.asarray(leaf)
            if leaf.shape != out.shape[1:] or leaf.dtype != out.dtype:
                raise ValueError(f"{what}: expert {i} has shape {list(leaf.shape)} ({leaf.dtype}) where expert 0 "
                                 f"has {list(out.shape[1:])} ({out.dtype})")
            out[i] = leaf
        del value, leaves
        n = i + 1
    if n != count:
        raise ValueError(f"{what}: {n} experts, expected {count}")
    return jax.tree_util.tree_unflatten(treedef, outs)


def logical_shape(w: Any) -> tuple[int, ...]:
    """[..., out, in] of a container, or the array's shape."""
    return tuple(w.shape)


def resident_bytes(tree: Any) -> int:
    """Bytes held by the arrays of a pytree (containers count their packed arrays and scales)."""
    return int(sum(int(a.size) * jnp.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(tree)))
