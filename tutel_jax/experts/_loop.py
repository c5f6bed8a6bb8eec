"""A grouped expert matmul as a loop over the non-empty groups: the CPU decode path.

`grouped(experts, params, rows, group_sizes)` computes what `experts.grouped` does (rows [N, M] sorted by
expert, group_sizes [E] rows per expert -> [N, M_out]) one expert at a time over the experts that received
rows, in chunks of `chunk` rows. An expert that received nothing costs nothing and its weights are never read;
each used expert's weights are read once (its chunks reuse them from cache). On XLA:CPU, where `ragged_dot` is
dense-masked (every row times every expert) and a batched [E, C, M] matmul pads every expert to the largest
count, this is what decoding a few tokens is bound by: reading the used experts' weights once.

Differentiable: the backward pass is the same loop over the VJP of `batched` (float parameters and rows).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from ..core import summed_like, varying_like

__all__ = ["grouped", "chunk_rows"]


def chunk_rows(num_rows: int, num_experts: int) -> int:
    """Rows per matmul: the average group rounded up to a power of two, within [2, 8] (a decode step's experts
    mostly receive one or two rows; larger chunks only pad more)."""
    mean = max(1, -(-num_rows // num_experts))
    return min(8, max(2, 1 << (mean - 1).bit_length()))


def grouped(experts: Any, params: Any, rows: jax.Array, group_sizes: jax.Array, chunk: int | None = None
            ) -> jax.Array:
    """experts.grouped(params, rows [N, M], group_sizes [E]) -> [N, M_out], looping over the used experts.

    `experts` needs `batched` (run on one expert's [1, chunk, M] rows; every parameter leaf leads with E).
    chunk: rows per matmul (default `chunk_rows`). Rows past sum(group_sizes) come out as zeros (the dropless
    path passes exactly sum(group_sizes) rows)."""
    if chunk is None:
        chunk = chunk_rows(rows.shape[0], group_sizes.shape[0])
    return _loop(experts, int(chunk), params, rows, group_sizes)


class _Groups:
    """Where each expert's rows sit in the sorted rows, and the loop over the used experts' chunks."""

    def __init__(self, group_sizes: jax.Array, chunk: int):
        self.sizes = group_sizes.astype(jnp.int32)
        self.starts = jnp.cumsum(self.sizes) - self.sizes
        used = self.sizes > 0
        self.order = jnp.argsort(~used, stable=True)  # the used experts first
        self.num_used = jnp.sum(used.astype(jnp.int32))
        self.chunk = chunk

    def pad(self, a: jax.Array) -> jax.Array:
        """a [N, ...] with `chunk` zero rows appended (room for a group's last chunk)."""
        return jnp.concatenate([a, jnp.zeros((self.chunk,) + a.shape[1:], a.dtype)])

    def run(self, per_chunk, per_expert_init, per_expert_done, carry):
        """for each used expert e: acc = per_expert_init(e); for each chunk (first row, keep [chunk, 1]):
        acc, carry = per_chunk(e, first, keep, acc, carry); carry = per_expert_done(e, acc, carry)."""
        def one_expert(j, carry):
            e = self.order[j]

            def one_chunk(c, state):
                first = self.starts[e] + c * self.chunk
                keep = (jnp.arange(self.chunk) < self.sizes[e] - c * self.chunk)[:, None]
                return per_chunk(e, first, keep, *state)

            n = (self.sizes[e] + self.chunk - 1) // self.chunk
            acc, carry = jax.lax.fori_loop(0, n, one_chunk, (per_expert_init(e), carry))
            return per_expert_done(e, acc, carry)

        return jax.lax.fori_loop(0, self.num_used, one_expert, carry)


def _expert(params: Any, e: jax.Array) -> Any:
    """Expert e's parameters, each leaf [1, ...] (sliced inside the loop: only used experts are read)."""
    return jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, e, keepdims=True), params)


def _is_float(a: Any) -> bool:
    return jnp.issubdtype(a.dtype, jnp.inexact)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _loop(experts, chunk, params, rows, group_sizes):
    groups = _Groups(group_sizes, chunk)
    padded = groups.pad(rows)
    shape = jax.eval_shape(lambda: experts.batched(_expert(params, 0), padded[None, :chunk]))
    out = varying_like(groups.pad(jnp.zeros((rows.shape[0],) + shape.shape[2:], shape.dtype)), params, rows,
                        group_sizes)

    def per_chunk(e, first, keep, params_e, out):
        y = experts.batched(params_e, jax.lax.dynamic_slice_in_dim(padded, first, chunk)[None])[0]
        y = jnp.where(keep, y.astype(out.dtype), jax.lax.dynamic_slice_in_dim(out, first, chunk))
        return params_e, jax.lax.dynamic_update_slice_in_dim(out, y, first, 0)

    out = groups.run(per_chunk, lambda e: _expert(params, e), lambda e, acc, out: out, out)
    return out[:rows.shape[0]]


def _loop_fwd(experts, chunk, params, rows, group_sizes):
    return _loop(experts, chunk, params, rows, group_sizes), (params, rows, group_sizes)


def _loop_bwd(experts, chunk, residuals, g):
    """The same loop transposed: per used expert and chunk, the VJP of `batched` on those rows; the expert's
    float parameters' cotangents are summed over its chunks (integer / packed leaves get none)."""
    params, rows, group_sizes = residuals
    groups = _Groups(group_sizes, chunk)
    padded, g_padded = groups.pad(rows), groups.pad(g)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    is_float = [_is_float(a) for a in leaves]

    def expert_parts(e):
        parts = jax.tree_util.tree_leaves(_expert(params, e))
        return [a for a, f in zip(parts, is_float) if f], [a for a, f in zip(parts, is_float) if not f]

    def per_chunk(e, first, keep, acc, carry):
        d_params, d_rows = carry
        floats, others = expert_parts(e)

        def run(floats, x):
            it_f, it_o = iter(floats), iter(others)
            p = jax.tree_util.tree_unflatten(treedef, [next(it_f) if f else next(it_o) for f in is_float])
            return experts.batched(p, x[None])[0]

        x = jax.lax.dynamic_slice_in_dim(padded, first, chunk)
        y, vjp = jax.vjp(run, floats, x)
        ct = jnp.where(keep, jax.lax.dynamic_slice_in_dim(g_padded, first, chunk), 0).astype(y.dtype)
        df, dx = vjp(ct)
        dx = jnp.where(keep, dx.astype(d_rows.dtype), jax.lax.dynamic_slice_in_dim(d_rows, first, chunk))
        return [a + b for a, b in zip(acc, df)], (d_params, jax.lax.dynamic_update_slice_in_dim(d_rows, dx, first, 0))

    def init(e):
        return varying_like([jnp.zeros_like(a) for a in expert_parts(e)[0]], params, rows, g, group_sizes)

    def done(e, acc, carry):
        d_params, d_rows = carry
        return [jax.lax.dynamic_update_index_in_dim(D, d.astype(D.dtype), e, 0) for D, d in zip(d_params, acc)], d_rows

    carry = varying_like(([jnp.zeros_like(a) for a, f in zip(leaves, is_float) if f], jnp.zeros_like(padded)),
                          params, rows, g, group_sizes)
    d_floats, d_rows = groups.run(per_chunk, init, done, carry)
    it = iter(d_floats)
    d_params = jax.tree_util.tree_unflatten(treedef, [next(it) if f else None for f in is_float])
    # the carries vary over every axis any input does; each cotangent must have its primal's type
    return summed_like(d_params, params), summed_like(d_rows[:rows.shape[0]], rows), None


_loop.defvjp(_loop_fwd, _loop_bwd)
