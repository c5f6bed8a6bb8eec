"""Dispatch ops: encode/decode on the capacity buffer and permute/unpermute on the dropless layout, forward and
custom-VJP gradients, against tutel_jax.routing._dispatch (the reference semantics)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from tutel_jax.routing import _dispatch as tutel_dispatch

from support.kernels import KernelTestBase, assert_close, random_normal

SMALL = pk.DispatchConfig(block_rows=16, block_cols=32)


def _buffer_slots(logits, k, capacity):
    """[k, S] flat slots into [E * C] (dropped -> E * C) and the weights, from the reference gating."""
    routing = pk.gating_reference(logits, k)
    num_experts = logits.shape[1]
    slots = jnp.where(routing.locations < capacity, routing.expert_ids * capacity + routing.locations,
                      num_experts * capacity)
    return slots.astype(jnp.int32), routing


def test_reference_equals_tutel_dispatch():
    x = random_normal(0, (30, 20))
    slots, routing = _buffer_slots(random_normal(1, (30, 5)), 2, 7)
    np.testing.assert_array_equal(pk.encode_reference(x, routing.weights, slots, 35),
                                  tutel_dispatch.encode(x, routing.weights, slots, 35))
    data = random_normal(2, (35, 20))
    np.testing.assert_array_equal(pk.decode_reference(data, routing.weights, slots),
                                  tutel_dispatch.decode(data, routing.weights, slots))


def test_grouped_rows_equal_tutel():
    routing = pk.gating_reference(random_normal(3, (25, 6)), 3)
    plan = tutel_dispatch.RoutingPlan(routing.expert_ids, routing.locations, routing.weights, routing.counts,
                                      jnp.int32(99), 6, None)
    np.testing.assert_array_equal(pk.grouped_rows(routing.expert_ids, routing.locations, routing.counts),
                                  tutel_dispatch.grouped_slots(plan))


class TestDispatch(KernelTestBase):
    BACKENDS = ("xla", "interpret", "tpu_interpret")

    @pytest.mark.parametrize("tokens, experts, dim, k, capacity, dtype", [
        (37, 6, 40, 2, 9, jnp.float32),    # drops (capacity < load), dims not multiples of the blocks
        (50, 4, 24, 1, 20, jnp.bfloat16),  # k = 1, bf16, empty slots
        (20, 8, 16, 8, 3, jnp.float32),    # k = 8: every expert of every token, many drops
    ])
    def test_encode_decode(self, tokens, experts, dim, k, capacity, dtype):
        x = random_normal(tokens, (tokens, dim), dtype)
        slots, routing = _buffer_slots(random_normal(dim, (tokens, experts), scale=2.0), k, capacity)
        weights = routing.weights.astype(dtype)
        num_slots = experts * capacity
        out = self.call(pk.encode, x, weights, slots, static=dict(num_slots=num_slots, config=SMALL))
        assert out.dtype == x.dtype
        assert_close(out, tutel_dispatch.encode(x, weights, slots, num_slots), dtype, tol=0.0)  # exact
        data = random_normal(k, (num_slots, dim), dtype)
        out = self.call(pk.decode, data, weights, slots, static=dict(config=SMALL))
        assert_close(out, tutel_dispatch.decode(data, weights, slots), dtype)

    def test_every_token_to_one_expert(self):
        logits = random_normal(4, (33, 5)).at[:, 1].add(50.0)
        slots, routing = _buffer_slots(logits, 2, 12)  # expert 1 overflows: 21 of its 33 tokens drop
        x = random_normal(5, (33, 16))
        out = self.call(pk.encode, x, routing.weights, slots, static=dict(num_slots=60, config=SMALL))
        assert_close(out, tutel_dispatch.encode(x, routing.weights, slots, 60), tol=0.0)
        y = self.call(pk.decode, out, routing.weights, slots, static=dict(config=SMALL))
        assert_close(y, tutel_dispatch.decode(out, routing.weights, slots))

    def test_permute_unpermute_dropless(self):
        x = random_normal(6, (29, 24), jnp.bfloat16)
        routing = pk.gating_reference(random_normal(7, (29, 7)), 3)
        rows = pk.grouped_rows(routing.expert_ids, routing.locations, routing.counts)
        ones = jnp.ones_like(routing.weights)
        permuted = self.call(pk.permute, x, ones, rows, static=dict(config=SMALL))
        expected = tutel_dispatch.encode(x, ones, rows, 87)
        assert_close(permuted, expected, jnp.bfloat16, tol=0.0)
        out = self.call(pk.unpermute, permuted, routing.weights.astype(jnp.bfloat16), rows,
                        static=dict(config=SMALL))
        assert_close(out, tutel_dispatch.decode(expected, routing.weights.astype(jnp.bfloat16), rows), jnp.bfloat16)

    @staticmethod
    def _assert_same_gradients(ours, theirs, data, weights, cotangent):
        """Gradients of sum(fn(data, weights) * cotangent) w.r.t. both inputs: the kernel's (jitted) vs Tutel's."""
        def grads(fn, jit):
            g = jax.grad(lambda d, w: jnp.sum(fn(d, w) * cotangent), (0, 1))
            return (jax.jit(g) if jit else g)(data, weights)
        for a, b in zip(grads(ours, True), grads(theirs, False)):
            assert_close(a, b)

    def test_encode_gradients(self):
        x = random_normal(8, (26, 20))
        slots, routing = _buffer_slots(random_normal(9, (26, 4)), 2, 10)
        self._assert_same_gradients(
            lambda x, w: pk.encode(x, w, slots, 40, implementation=self.impl, config=SMALL),
            lambda x, w: tutel_dispatch.encode(x, w, slots, 40), x, routing.weights, random_normal(10, (40, 20)))

    def test_decode_gradients(self):
        data = random_normal(11, (40, 20))
        slots, routing = _buffer_slots(random_normal(12, (26, 4)), 3, 10)
        self._assert_same_gradients(
            lambda d, w: pk.decode(d, w, slots, implementation=self.impl, config=SMALL),
            lambda d, w: tutel_dispatch.decode(d, w, slots), data, routing.weights, random_normal(13, (26, 20)))

    def test_weight_gradients_with_the_row_dots_tiling(self):
        # k = 8 with the default config: the row-dots kernel shrinks its block (f32: 16 x 64 on the default
        # target), so its column loop runs 4 steps, the last one partial
        x = random_normal(14, (40, 200))
        slots, routing = _buffer_slots(random_normal(15, (40, 16)), 8, 24)
        self._assert_same_gradients(
            lambda x, w: pk.encode(x, w, slots, 384, implementation=self.impl),
            lambda x, w: tutel_dispatch.encode(x, w, slots, 384), x, routing.weights, random_normal(16, (384, 200)))


@pytest.mark.parametrize("target", sorted(pk.TARGETS))
def test_row_dots_config_within_the_target_budget(target):
    from pallas_kernels.dispatch import DISPATCH_TILINGS, row_dots_config
    from pallas_kernels.targets import get_target

    tiling, warp = DISPATCH_TILINGS[target], get_target(target).warp_size
    for dtype in (jnp.float32, jnp.bfloat16):
        itemsize = jnp.dtype(dtype).itemsize
        for cfg in (pk.default_dispatch_config(7168, dtype), pk.default_dispatch_config(24, dtype), SMALL):
            for k in (1, 2, 4, 8, 16, 64):
                out = row_dots_config(cfg, k, itemsize, target)
                assert out.block_rows == min(cfg.block_rows, tiling.row_dots_rows)
                assert out.block_cols <= cfg.block_cols and out.num_warps == cfg.num_warps
                assert out.block_cols == cfg.block_cols or out.block_cols >= 16
                if out.block_cols > 16:  # halved only as far as needed
                    budget = tiling.row_dots_thread_bytes * warp * cfg.num_warps
                    assert (k + 1) * out.block_rows * out.block_cols * itemsize <= budget
    # the prefill shapes of the offline report: k = 8 over bf16 rows, 16 x 128 on CUDA
    if target.startswith("sm_"):
        out = row_dots_config(pk.default_dispatch_config(7168, jnp.bfloat16), 8, 2, target)
        assert (out.block_rows, out.block_cols) == (16, 128)
