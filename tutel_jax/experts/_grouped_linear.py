"""The grouped-linear primitive every expert type is written against: one weight per expert, three ways to run it.

  batched_linear(x [E, C, K], w)                               -> [E, C, N]  (capacity buffers)
  grouped_linear(x [R, K], w, group_sizes [E], backend)        -> [R, N]     (dropless: rows sorted by expert)
  gathered_linear(x [R, K], w, expert_ids [R])                 -> [R, N]     (a few rows: only their experts read)

`w` is one of
  * a float array [E, K, *N] (the kernel layout, `x @ w[e]`; trailing axes are flattened into N, so SwiGLU's
    fused [E, M, 2, I] is used as its [E, M, 2I] view), or with `out_in=True` a float array [E, N, K]
    (Tutel's `ffn` fc1, used as `x @ w[e].T`);
  * a packed quantized weight (`pallas_kernels.quant` container: FP8 block, MXFP4, NVFP4) in the checkpoint's
    [E, N, K] ([out, in]) layout, whatever `out_in` says.

Layout choice. Float and packed weights keep different layouts on purpose. Float weights are [in, out] because
that is what the tuned XLA paths (dot_general / `lax.ragged_dot` without a transpose), the Pallas `gmm` kernel
and the native C++ CPU kernel (`native/moe_cpu.cc` streams gate_up [E, M, 2I] row by row) read; moving them to
[out, in] would add a transpose to every float matmul (or rewrite the C++ kernel). Packed weights are [out, in]
because the blocks and scales of FP8-block / MXFP4 / NVFP4 run along the `in` axis of the checkpoint's [out, in]
tensors, which is what `pallas_kernels.quant_gmm` dequantizes tile by tile; re-blocking them to [in, out] would
change the kernels and the checkpoint mapping. This module hides the difference, so the expert math
(`experts.FFNExperts`, `LlamaFFNExperts`, `experts_glu.SwiGLUExperts`, `GptOssExperts`) is written once over
`Batched` / `Grouped` / `Gathered` (each a `linear(x, w)` and a per-row `bias(b, dtype)`).

Backends: `backend` resolves through `core.kernels` (None / "auto": the kernels of the platform the program
is compiled for; "xla": plain XLA): `grouped_linear` runs float weights through `pallas_kernels.gmm` or, for plain
XLA, `lax.ragged_dot`, and packed weights through `pallas_kernels.quant_gmm` (its kernel, or its float32 XLA
reference). The native CPU kernel takes a whole SwiGLU layer (`tutel_jax.native.moe_swiglu`) and is chosen as
`dropless_impl='native'` for float SwiGLU experts. `batched_linear` / `gathered_linear` dequantize packed weights
in XLA. Packed weights are for inference: the kernels have no VJP.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import pallas_kernels

from .. import core, quant
from ..routing import group_row_experts

__all__ = ["batched_linear", "grouped_linear", "gathered_linear", "Batched", "Grouped", "Gathered", "Mode"]


def _kernel_view(w: jax.Array) -> jax.Array:
    """A float [E, K, *N] weight as [E, K, N]."""
    return w if w.ndim == 3 else w.reshape(w.shape[0], w.shape[1], -1)


def batched_linear(x: jax.Array, w: Any, *, out_in: bool = False, backend: str | None = None) -> jax.Array:
    """x [E, C, K] through each expert's weight -> [E, C, N] in x's dtype. Packed weights go through the grouped
    quantized kernel (C rows per expert) where `backend` resolves to kernels (`core.kernels`), so the
    capacity path never dequantizes a whole layer on a GPU or TPU; elsewhere they are dequantized in XLA."""
    if quant.is_quantized(w) and (kernels := core.kernels(backend)) is not None:
        num_experts, capacity, _ = x.shape
        sizes = jnp.full((num_experts,), capacity, jnp.int32)
        rows = pallas_kernels.quant_gmm(x.reshape(num_experts * capacity, -1), w, sizes, out_dtype=x.dtype,
                                        implementation=kernels)
        return rows.reshape(num_experts, capacity, -1)
    if quantized := quant.is_quantized(w):
        w = quant.dequantize(w, x.dtype)
    if quantized or out_in:
        return jnp.einsum("eck,enk->ecn", x, w if quantized else w.astype(x.dtype))
    return jnp.einsum("eck,ekn->ecn", x, _kernel_view(w).astype(x.dtype))


def grouped_linear(x: jax.Array, w: Any, group_sizes: jax.Array, backend: str | None = None, *,
                   out_in: bool = False) -> jax.Array:
    """x [R, K] with rows sorted by expert (group_sizes [E] rows each) -> [R, N]; rows past sum(group_sizes)
    come out as zeros."""
    backend = core.kernels(backend)  # the compile platform's kernels unless set
    if quant.is_quantized(w):
        return pallas_kernels.quant_gmm(x, w, group_sizes.astype(jnp.int32), out_dtype=x.dtype,
                                        implementation="xla" if backend is None else backend)
    w = jnp.swapaxes(w, 1, 2) if out_in else _kernel_view(w)
    if backend is None:
        return jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes)
    return pallas_kernels.gmm(x, w.astype(x.dtype), group_sizes, implementation=backend)


def gathered_linear(x: jax.Array, w: Any, expert_ids: jax.Array, *, out_in: bool = False) -> jax.Array:
    """x [R, K], row r through expert expert_ids[r] -> [R, N]; only the R chosen experts' (packed) weights are
    read (and dequantized)."""
    if quant.is_quantized(w):
        rows = jax.tree_util.tree_map(lambda a: a[expert_ids], w)
        return jnp.einsum("rk,rnk->rn", x, quant.dequantize(rows, x.dtype))
    if out_in:
        return jnp.einsum("rk,rnk->rn", x, w[expert_ids].astype(x.dtype))
    return jnp.einsum("rk,rkn->rn", x, _kernel_view(w[expert_ids]).astype(x.dtype))


class Mode:
    """How an expert's math runs: `linear(x, w)` (the primitive above) and `bias(b [E, N], dtype)` (b broadcast
    to the rows of `linear`'s output). `Batched`, `Grouped` and `Gathered` are the three."""

    def linear(self, x: jax.Array, w: Any, *, out_in: bool = False) -> jax.Array:
        raise NotImplementedError

    def bias(self, b: jax.Array, dtype: Any) -> jax.Array:
        raise NotImplementedError


class Batched(Mode):
    """Capacity buffers x [E, C, K]; `backend`: the experts' kernel_backend (packed weights' kernel)."""

    def __init__(self, backend: str | None = None):
        self.backend = backend

    def linear(self, x, w, *, out_in=False):
        return batched_linear(x, w, out_in=out_in, backend=self.backend)

    def bias(self, b, dtype):
        return b[:, None, :].astype(dtype)


class Grouped(Mode):
    """Rows [R, K] sorted by expert; `with_rows`: the expert of each row is needed (biases), computed up front."""

    def __init__(self, group_sizes: jax.Array, num_rows: int, backend: str | None = None, with_rows: bool = False):
        self.group_sizes, self.num_rows, self.backend = group_sizes, num_rows, backend
        self.rows = group_row_experts(group_sizes, num_rows) if with_rows else None

    def linear(self, x, w, *, out_in=False):
        return grouped_linear(x, w, self.group_sizes, self.backend, out_in=out_in)

    def bias(self, b, dtype):
        if self.rows is None:
            self.rows = group_row_experts(self.group_sizes, self.num_rows)
        return b.astype(dtype)[self.rows]


class Gathered(Mode):
    """Rows [R, K], row r through expert expert_ids[r]."""

    def __init__(self, expert_ids: jax.Array):
        self.expert_ids = expert_ids

    def linear(self, x, w, *, out_in=False):
        return gathered_linear(x, w, self.expert_ids, out_in=out_in)

    def bias(self, b, dtype):
        return b[self.expert_ids].astype(dtype)
