"""The grouped-linear primitive every expert type is written against: one weight per expert, three ways to run it.

  batched_linear(x [E, C, K], w)                               -> [E, C, N]  (capacity buffers)
  grouped_linear(x [R, K], w, group_sizes [E], backend)        -> [R, N]     (dropless: rows sorted by expert)
  gathered_linear(x [R, K], w, expert_ids [R])                 -> [R, N]     (a few rows: only their experts read)

`w` is one weight in one layout, [E, N, K] ([out, in], as Hugging Face checkpoints store each expert's linear
weight), float or packed alike: a float array, or a packed quantized container (`pallas_kernels.quant`: FP8 block,
MXFP4, NVFP4) whose `logical_shape` is that same [E, N, K]. The routed experts of the model families hold every
weight this way (`experts_glu.SwiGLUExperts`, `GptOssExperts`), as do the shared experts and the models' dense
layers, so a float and a packed layer are the same pytree and every consumer (these modes, the native CPU kernel,
checkpoint IO, memory reports) takes both the same way. The one exception is Tutel's own parameters (`ffn`'s fc2,
`llama_ffn`'s three weights, kept in Tutel's state-dict layout for Tutel checkpoints): they are float [E, K, N]
and say so with `in_out=True`, which is read as the contraction's other axis (no transposed copy).

Backends: `backend` resolves through `core.kernels` (None / "auto": the kernels of the platform the program
is compiled for; "xla": plain XLA): `grouped_linear` runs float weights through `pallas_kernels.gmm` (reading
[out, in] with `transpose_rhs`) or, for plain XLA, `lax.ragged_dot_general`, and packed weights through
`pallas_kernels.quant_gmm` (its kernel, or its float32 XLA reference). The native CPU kernel takes a whole GLU
layer (`tutel_jax.native.moe_experts`, the same weights) and is chosen as `dropless_impl='native'`.
`batched_linear` / `gathered_linear` dequantize packed weights in XLA. Packed weights are for inference: the
kernels have no VJP.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import pallas_kernels

from .. import core, quant
from ..routing import group_row_experts

__all__ = ["batched_linear", "grouped_linear", "gathered_linear", "Batched", "Grouped", "Gathered", "Mode"]


# ragged_dot_general's dimensions for x [R, K] against w [E, N, K] (rows grouped by expert, contraction on K)
_OUT_IN_DIMS = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                                 lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def _float_weight(w: jax.Array) -> jax.Array:
    """A float expert weight [E, N, K] (or Tutel's [E, K, N]), checked."""
    if w.ndim != 3:
        raise ValueError(f"expert weights are [E, out, in] (or Tutel's [E, in, out]), got shape {tuple(w.shape)}")
    return w


def _packed(w: Any, in_out: bool) -> bool:
    """Whether w is a packed container; packed weights are [E, N, K] only."""
    if not quant.is_quantized(w):
        return False
    if in_out:
        raise ValueError("a packed expert weight is [E, out, in]; in_out=True is for Tutel's float weights")
    return True


def batched_linear(x: jax.Array, w: Any, *, in_out: bool = False, backend: str | None = None) -> jax.Array:
    """x [E, C, K] through each expert's weight -> [E, C, N] in x's dtype. Packed weights go through the grouped
    quantized kernel (C rows per expert) where `backend` resolves to kernels (`core.kernels`), so the
    capacity path never dequantizes a whole layer on a GPU or TPU; elsewhere they are dequantized in XLA."""
    if _packed(w, in_out):
        if (kernels := core.kernels(backend)) is not None:
            num_experts, capacity, _ = x.shape
            sizes = jnp.full((num_experts,), capacity, jnp.int32)
            rows = pallas_kernels.quant_gmm(x.reshape(num_experts * capacity, -1), w, sizes, out_dtype=x.dtype,
                                            implementation=kernels)
            return rows.reshape(num_experts, capacity, -1)
        w = quant.dequantize(w, x.dtype)
    else:
        w = _float_weight(w).astype(x.dtype)
    return jnp.einsum("eck,ekn->ecn" if in_out else "eck,enk->ecn", x, w)


def grouped_linear(x: jax.Array, w: Any, group_sizes: jax.Array, backend: str | None = None, *,
                   in_out: bool = False) -> jax.Array:
    """x [R, K] with rows sorted by expert (group_sizes [E] rows each) -> [R, N]; rows past sum(group_sizes)
    come out as zeros."""
    backend = core.kernels(backend)  # the compile platform's kernels unless set
    if _packed(w, in_out):
        return pallas_kernels.quant_gmm(x, w, group_sizes.astype(jnp.int32), out_dtype=x.dtype,
                                        implementation="xla" if backend is None else backend)
    w = _float_weight(w).astype(x.dtype)
    if backend is not None:
        return pallas_kernels.gmm(x, w, group_sizes, transpose_rhs=not in_out, implementation=backend)
    if in_out:
        return jax.lax.ragged_dot(x, w, group_sizes)
    return jax.lax.ragged_dot_general(x, w, group_sizes, _OUT_IN_DIMS)


def gathered_linear(x: jax.Array, w: Any, expert_ids: jax.Array, *, in_out: bool = False) -> jax.Array:
    """x [R, K], row r through expert expert_ids[r] -> [R, N]; only the R chosen experts' (packed) weights are
    read (and dequantized)."""
    if _packed(w, in_out):
        rows = jax.tree_util.tree_map(lambda a: a[expert_ids], w)
        return jnp.einsum("rk,rnk->rn", x, quant.dequantize(rows, x.dtype))
    w = _float_weight(w)[expert_ids].astype(x.dtype)  # the chosen experts only, then cast
    return jnp.einsum("rk,rkn->rn" if in_out else "rk,rnk->rn", x, w)


class Mode:
    """How an expert's math runs: `linear(x, w)` (the primitive above) and `bias(b [E, N], dtype)` (b broadcast
    to the rows of `linear`'s output). `Batched`, `Grouped` and `Gathered` are the three."""

    def linear(self, x: jax.Array, w: Any, *, in_out: bool = False) -> jax.Array:
        raise NotImplementedError

    def bias(self, b: jax.Array, dtype: Any) -> jax.Array:
        raise NotImplementedError


class Batched(Mode):
    """Capacity buffers x [E, C, K]; `backend`: the experts' kernel_backend (packed weights' kernel)."""

    def __init__(self, backend: str | None = None):
        self.backend = backend

    def linear(self, x, w, *, in_out=False):
        return batched_linear(x, w, in_out=in_out, backend=self.backend)

    def bias(self, b, dtype):
        return b[:, None, :].astype(dtype)


class Grouped(Mode):
    """Rows [R, K] sorted by expert; `with_rows`: the expert of each row is needed (biases), computed up front."""

    def __init__(self, group_sizes: jax.Array, num_rows: int, backend: str | None = None, with_rows: bool = False):
        self.group_sizes, self.num_rows, self.backend = group_sizes, num_rows, backend
        self.rows = group_row_experts(group_sizes, num_rows) if with_rows else None

    def linear(self, x, w, *, in_out=False):
        return grouped_linear(x, w, self.group_sizes, self.backend, in_out=in_out)

    def bias(self, b, dtype):
        if self.rows is None:
            self.rows = group_row_experts(self.group_sizes, self.num_rows)
        return b.astype(dtype)[self.rows]


class Gathered(Mode):
    """Rows [R, K], row r through expert expert_ids[r]."""

    def __init__(self, expert_ids: jax.Array):
        self.expert_ids = expert_ids

    def linear(self, x, w, *, in_out=False):
        return gathered_linear(x, w, self.expert_ids, in_out=in_out)

    def bias(self, b, dtype):
        return b[self.expert_ids].astype(dtype)
