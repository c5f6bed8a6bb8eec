"""Gating op: the reference equals Tutel's routing plan exactly; the kernel (interpret mode) equals the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from tutel_jax.routing import slot_positions as tutel_slot_positions
from tutel_jax.routing import top_k_routing

from support.kernels import KernelTestBase, assert_close, random_normal

SMALL = pk.GatingConfig(block_tokens=16, num_warps=4)


def _assert_same_routing(out: pk.GatingResult, ref: pk.GatingResult, weight_tol: float = 1e-6):
    np.testing.assert_array_equal(out.expert_ids, ref.expert_ids)
    np.testing.assert_array_equal(out.locations, ref.locations)
    np.testing.assert_array_equal(out.counts, ref.counts)
    assert_close(out.weights, ref.weights, tol=weight_tol)
    assert_close(out.scores, ref.scores, tol=weight_tol)


# ------------------------------------------------------------------- reference == Tutel (XLA only, cheap)


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("batch_prioritized", [False, True])
def test_reference_equals_tutel_plan(k, batch_prioritized):
    logits = random_normal(k, (53, 12), scale=2.0)
    ref = pk.gating_reference(logits, k, batch_prioritized_routing=batch_prioritized)
    plan = top_k_routing(jax.nn.softmax(logits, axis=1), k, 0.0, batch_prioritized_routing=batch_prioritized)
    np.testing.assert_array_equal(ref.expert_ids, plan.expert_ids)
    np.testing.assert_array_equal(ref.locations, plan.locations)
    np.testing.assert_array_equal(ref.weights, plan.gates)  # bit-identical
    np.testing.assert_array_equal(ref.counts, plan.dispatch_count)


def test_reference_slot_positions_equal_tutel():
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 7, (3, 41)), jnp.int32)
    order = jnp.asarray(np.random.RandomState(1).permutation(41), jnp.int32)
    for priority in (None, order):
        ours = pk.slot_positions_reference(ids, 7, priority)
        theirs = tutel_slot_positions(ids, 7, priority)
        np.testing.assert_array_equal(ours[0], theirs[0])
        np.testing.assert_array_equal(ours[1], theirs[1])


def _hf_deepseek_np(logits, bias, k, n_group, topk_group, norm, scale, fill):
    """NumPy transcription of HF transformers' DeepSeek-V3 router (float32), ids sorted by selection score."""
    s = 1.0 / (1.0 + np.exp(-logits.astype(np.float32)))
    sel = s + bias[None, :]
    tokens, experts = sel.shape
    grouped = sel.reshape(tokens, n_group, experts // n_group)
    group_scores = np.sort(grouped, axis=-1)[..., ::-1][..., :2].sum(-1)
    keep = np.argsort(-group_scores, axis=1, kind="stable")[:, :topk_group]
    mask = np.zeros((tokens, n_group), bool)
    np.put_along_axis(mask, keep, True, axis=1)
    sel = np.where(np.repeat(mask, experts // n_group, axis=1), sel, fill)
    ids = np.argsort(-sel, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(s, ids, axis=1)
    if norm:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return ids.T, (w * scale).T


@pytest.mark.parametrize("fill", [0.0, -np.inf])
def test_sigmoid_reference_matches_hf_router(fill):
    logits = np.asarray(random_normal(3, (40, 16)))
    bias = np.asarray(random_normal(4, (16,), scale=0.3))
    ref = pk.gating_reference(jnp.asarray(logits), 4, score_fn="sigmoid", correction_bias=jnp.asarray(bias),
                              n_group=4, topk_group=2, group_fill_value=fill, routed_scaling_factor=2.5)
    ids, w = _hf_deepseek_np(logits, bias, 4, 4, 2, True, 2.5, fill)
    np.testing.assert_array_equal(ref.expert_ids, ids)
    np.testing.assert_allclose(ref.weights, w, rtol=1e-6)
    locations, counts = tutel_slot_positions(ref.expert_ids, 16)
    np.testing.assert_array_equal(ref.locations, locations)
    np.testing.assert_array_equal(ref.counts, counts)


def test_argument_validation():
    logits = jnp.zeros((4, 6))
    with pytest.raises(ValueError, match="n_group"):
        pk.gating(logits, 2, n_group=4)
    with pytest.raises(ValueError, match="score_fn"):
        pk.gating(logits, 2, score_fn="relu")
    with pytest.raises(ValueError, match="top_k"):
        pk.gating(logits, 0)


# ------------------------------------------------------------------------- kernel vs reference (both impls)


class TestGating(KernelTestBase):
    @pytest.mark.parametrize("tokens, experts, k, dtype", [
        (37, 8, 2, jnp.float32),     # tokens not a multiple of the block, one partial block
        (64, 5, 3, jnp.float32),     # E not a power of two
        (100, 16, 8, jnp.bfloat16),  # k = 8, bf16 logits
        (16, 4, 1, jnp.float32),     # k = 1 (no normalisation), single block
    ])
    def test_softmax(self, tokens, experts, k, dtype):
        logits = random_normal(tokens + k, (tokens, experts), dtype, scale=2.0)
        out = self.call(pk.gating, logits, static=dict(top_k=k, config=SMALL))
        _assert_same_routing(out, pk.gating_reference(logits, k))

    def test_every_token_to_one_expert(self):
        logits = random_normal(5, (45, 8)).at[:, 3].add(100.0)
        out = self.call(pk.gating, logits, static=dict(top_k=2, config=SMALL))
        ref = pk.gating_reference(logits, 2)
        _assert_same_routing(out, ref)
        assert int(out.counts[3]) == 45
        np.testing.assert_array_equal(np.sort(out.locations[0]), np.arange(45))

    def test_sigmoid_group_limited(self):
        # E = 24 pads to 32 in the kernel: padded experts must stay unselectable after the 0.0 group fill
        logits = random_normal(6, (50, 24))
        bias = random_normal(7, (24,), scale=0.5)
        static = dict(top_k=6, score_fn="sigmoid", n_group=4, topk_group=2, group_fill_value=0.0,
                      routed_scaling_factor=2.5, config=SMALL)
        out = self.call(pk.gating, logits, correction_bias=bias, static=static)
        static.pop("config")
        _assert_same_routing(out, pk.gating_reference(logits, correction_bias=bias, **static))

    @pytest.mark.parametrize("experts, n_group, topk_group, k, fill, block", [
        (64, 8, 3, 8, -np.inf, 16),  # power-of-two groups (DeepSeek-V3's layout), the -inf fill
        (30, 3, 2, 5, 0.0, 8),       # 3 groups of 10: groups padded to 4 x 16 columns, 8-token blocks
    ])
    def test_group_layouts(self, experts, n_group, topk_group, k, fill, block):
        logits = random_normal(9 + experts, (45, experts), scale=1.5)
        bias = random_normal(10 + experts, (experts,), scale=0.5)
        static = dict(top_k=k, score_fn="sigmoid", n_group=n_group, topk_group=topk_group, group_fill_value=fill)
        out = self.call(pk.gating, logits, correction_bias=bias,
                        static=dict(static, config=pk.GatingConfig(block_tokens=block, num_warps=4)))
        _assert_same_routing(out, pk.gating_reference(logits, correction_bias=bias, **static))

    def test_softmax_groups_without_bias(self):
        # softmax scores with a group limit and no bias: weights come from the scores, not the selection
        logits = random_normal(11, (33, 16), scale=2.0)
        static = dict(top_k=3, n_group=4, topk_group=2)
        out = self.call(pk.gating, logits, static=dict(static, config=SMALL))
        _assert_same_routing(out, pk.gating_reference(logits, **static))

    def test_batch_prioritized(self):
        logits = random_normal(8, (40, 6), scale=2.0)
        out = self.call(pk.gating, logits, static=dict(top_k=2, batch_prioritized_routing=True, config=SMALL))
        plan = top_k_routing(jax.nn.softmax(logits, axis=1), 2, 0.0, batch_prioritized_routing=True)
        np.testing.assert_array_equal(out.expert_ids, plan.expert_ids)
        np.testing.assert_array_equal(out.locations, plan.locations)
        assert_close(out.weights, plan.gates, tol=1e-6)

    def test_slot_positions(self):
        ids = jnp.asarray(np.random.RandomState(2).randint(0, 9, (3, 70)), jnp.int32)
        locations, counts = self.call(pk.slot_positions, ids, static=dict(num_experts=9, config=SMALL))
        ref = tutel_slot_positions(ids, 9)
        np.testing.assert_array_equal(locations, ref[0])
        np.testing.assert_array_equal(counts, ref[1])


# ------------------------------------------------------------------------------------- tiling (no kernel run)


@pytest.mark.parametrize("target", sorted(pk.TARGETS))
def test_default_config_within_the_target_budget(target):
    from pallas_kernels.gating import GATING_TILINGS, default_gating_config
    from pallas_kernels.targets import get_target

    tiling, warp = GATING_TILINGS[target], get_target(target).warp_size
    for tokens in (1, 8, 100, 2048):
        for experts in (2, 8, 24, 32, 128, 256, 1024):
            for grouped in (False, True):
                cfg = default_gating_config(tokens, experts, grouped=grouped, target=target)
                width = 1 << max(experts - 1, 0).bit_length()
                per_thread = tiling.grouped_thread_elements if grouped else tiling.thread_elements
                assert 8 <= cfg.block_tokens <= min(tiling.max_block_tokens, max(8, 1 << (tokens - 1).bit_length()))
                assert 4 <= cfg.num_warps <= tiling.max_warps
                # within the budget, unless already at the smallest block and the most warps
                if cfg.block_tokens > 8 or cfg.num_warps < tiling.max_warps:
                    assert cfg.block_tokens * width <= per_thread * warp * cfg.num_warps


def test_group_layout_limits_the_kernel(monkeypatch):
    """720 experts in 5 groups pad to 8 x 256 columns: past the register tile, so "auto" uses XLA."""
    from pallas_kernels import _select

    monkeypatch.setattr(_select, "compile_platform", lambda: "gpu")
    logits = random_normal(0, (4, 720))
    fn = lambda l, **kw: pk.gating(l, 2, score_fn="sigmoid", n_group=5, topk_group=2, **kw).expert_ids
    assert "pallas_call" not in str(jax.make_jaxpr(fn)(logits))
    with pytest.raises(pk.NotSupported):
        jax.make_jaxpr(lambda l: fn(l, implementation="pallas"))(logits)
