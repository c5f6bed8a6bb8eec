"""Grouped matmul: gmm / tgmm against lax.ragged_dot, the custom VJP, the tile schedule, and the expert-layer
hook (FFNExperts / LlamaFFNExperts `kernel_backend`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from tutel_jax.experts import make_experts

from support.kernels import KernelTestBase, assert_close, random_normal

SMALL = pk.GmmConfig(block_m=16, block_n=32, block_k=16, num_warps=4, num_stages=1)


@pytest.mark.parametrize("sizes, rows, block", [
    ([10, 0, 17, 20], 50, 16), ([0, 64, 0], 64, 16), ([5, 5, 5], 37, 8 * 2), ([0, 0], 9, 16), ([40], 40, 32)])
def test_group_metadata_covers_every_row_once(sizes, rows, block):
    """Each row is stored by exactly one work item (its group's, or the zero-filling pseudo group's)."""
    group, tile, starts, ends = (np.asarray(a) for a in pk.group_metadata(jnp.asarray(sizes, jnp.int32), rows, block))
    owners = np.zeros(rows, int)
    for g, t in zip(group, tile):
        if g > len(sizes):
            continue  # unused work item
        r = np.arange(t * block, (t + 1) * block)
        owners[r[(r >= starts[g]) & (r < ends[g]) & (r < rows)]] += 1
    np.testing.assert_array_equal(owners, 1)


class TestGmm(KernelTestBase):
    BACKENDS = ("xla", "interpret", "tpu_interpret")

    @pytest.mark.parametrize("rows, k, n, sizes, dtype", [
        (50, 40, 24, [10, 0, 17, 20], jnp.float32),  # empty group, rows past the sum, ragged dims
        (64, 32, 48, [0, 64, 0], jnp.float32),       # every row in one group
        (37, 24, 40, [5, 9, 13, 10], jnp.bfloat16),  # bf16, groups straddling tiles
    ])
    def test_forward(self, rows, k, n, sizes, dtype):
        lhs = random_normal(rows, (rows, k), dtype)
        rhs = random_normal(k, (len(sizes), k, n), dtype)
        sizes = jnp.asarray(sizes, jnp.int32)
        out = self.call(pk.gmm, lhs, rhs, sizes, static=dict(config=SMALL))
        assert out.dtype == dtype
        assert_close(out, jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32), dtype)
        if sum(np.asarray(sizes)) < rows:
            assert not np.any(np.asarray(out[int(np.sum(sizes)):], np.float32))  # zeros past the groups

    def test_transposed_rhs(self):
        lhs = random_normal(0, (30, 24))
        rhs = random_normal(1, (3, 20, 24))  # [G, N, K], HF [out, in]
        sizes = jnp.asarray([12, 0, 18], jnp.int32)
        out = self.call(pk.gmm, lhs, rhs, sizes, static=dict(config=SMALL, transpose_rhs=True))
        assert_close(out, jax.lax.ragged_dot(lhs, jnp.swapaxes(rhs, 1, 2), sizes))

    @pytest.mark.parametrize("rows, k, n, sizes, dtype", [
        (45, 24, 40, [10, 0, 30], jnp.float32),  # empty group -> zero block; 5 rows past the sum ignored
        (32, 16, 16, [32], jnp.bfloat16),
    ])
    def test_tgmm(self, rows, k, n, sizes, dtype):
        lhs = random_normal(rows, (rows, k), dtype)
        grad = random_normal(n, (rows, n), dtype)
        sizes = jnp.asarray(sizes, jnp.int32)
        out = self.call(pk.tgmm, lhs, grad, sizes, static=dict(config=SMALL))
        assert_close(out, pk.tgmm_reference(lhs, grad, sizes, preferred_element_type=jnp.float32), dtype)

    @pytest.mark.parametrize("transpose_rhs", [False, True])
    def test_gradients(self, transpose_rhs):
        lhs = random_normal(2, (40, 24))
        rhs = random_normal(3, (3, 20, 24) if transpose_rhs else (3, 24, 20))
        sizes = jnp.asarray([15, 0, 20], jnp.int32)
        cotangent = random_normal(4, (40, 20))

        def loss(fn):
            return lambda a, b: jnp.sum(fn(a, b) * cotangent)

        ours = jax.jit(jax.grad(loss(lambda a, b: pk.gmm(
            a, b, sizes, transpose_rhs=transpose_rhs, implementation=self.impl, config=SMALL, tgmm_config=SMALL)),
            (0, 1)))(lhs, rhs)
        as_kn = (lambda b: jnp.swapaxes(b, 1, 2)) if transpose_rhs else (lambda b: b)
        theirs = jax.grad(loss(lambda a, b: jax.lax.ragged_dot(a, as_kn(b), sizes)), (0, 1))(lhs, rhs)
        for a, b in zip(ours, theirs):
            assert_close(a, b)


@pytest.mark.parametrize("kind, options", [
    ("ffn", dict(hidden_size_per_expert=32, activation_fn="relu")),
    ("llama_ffn", dict(hidden_size_per_expert=32)),
])
def test_expert_layer_hook(kind, options):
    """experts={'kernel_backend': ...} routes the dropless grouped path through pallas_kernels.gmm."""
    default = make_experts({"type": kind, **options})
    kernel = make_experts({"type": kind, "kernel_backend": "interpret", **options})
    assert default.kernel_backend is None
    params = default.init(jax.random.key(0), 16, 3, jnp.float32)
    x = random_normal(5, (20, 16))
    sizes = jnp.asarray([7, 0, 13], jnp.int32)
    expected = default.grouped(params, x, sizes)
    assert_close(jax.jit(kernel.grouped)(params, x, sizes), expected)
    assert "pallas_call" in str(jax.make_jaxpr(kernel.grouped)(params, x, sizes))
    assert "pallas_call" not in str(jax.make_jaxpr(default.grouped)(params, x, sizes))
