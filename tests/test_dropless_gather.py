"""The 'gather' dropless path (each assignment through its own expert's gathered weights) equals the ragged
path for float and quantized SwiGLU / GPT-OSS experts, outputs and gradients (float32: 1e-5); 'auto' picks it
on CPU only for k*S <= E/2."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tutel_jax import dropless
from tutel_jax.config import make_config
from tutel_jax.layer import init_params, moe_apply

EXPERTS = {
    "swiglu": {"type": "swiglu", "count_per_node": 16, "hidden_size_per_expert": 32},
    "gpt_oss": {"type": "gpt_oss", "count_per_node": 16, "hidden_size_per_expert": 32},
    "swiglu_mxfp4": {"type": "swiglu", "count_per_node": 16, "hidden_size_per_expert": 32, "weight_format": "mxfp4"},
    "gpt_oss_fp8": {"type": "gpt_oss", "count_per_node": 16, "hidden_size_per_expert": 32,
                    "weight_format": "fp8_block"},
}
GATES = [{"type": "top", "k": 2}, {"type": "deepseek_v3", "k": 3, "n_group": 4, "topk_group": 2,
                                    "correction_bias": True, "routed_scaling_factor": 2.0}]


def _layer(experts, gate, impl):
    config = make_config(gate, 64, EXPERTS[experts], dropless_impl=impl)
    return config, init_params(config, jax.random.key(0))


@pytest.mark.parametrize("gate", GATES, ids=["tutel_top2", "deepseek_top3"])
@pytest.mark.parametrize("experts", sorted(EXPERTS))
def test_gather_equals_ragged(experts, gate):
    x = jax.random.normal(jax.random.key(1), (2, 3, 64))
    ys = {}
    for impl in ("ragged", "gather"):
        config, params = _layer(experts, gate, impl)
        ys[impl] = np.asarray(moe_apply(params, x, config, capacity_factor=0.0)[0])
    np.testing.assert_allclose(ys["gather"], ys["ragged"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("experts", ["swiglu", "gpt_oss"])
def test_gather_gradients_equal_ragged(experts):
    x = jax.random.normal(jax.random.key(2), (5, 64))
    grads = {}
    for impl in ("ragged", "gather"):
        config, params = _layer(experts, GATES[0], impl)
        loss = lambda p, x: jnp.sum(moe_apply(p, x, config, capacity_factor=0.0)[0] ** 2)
        grads[impl] = jax.grad(loss, argnums=(0, 1))(params, x)
    for a, b in zip(jax.tree_util.tree_leaves(grads["gather"]), jax.tree_util.tree_leaves(grads["ragged"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_auto_picks_gather_for_few_assignments_on_cpu():
    config, _ = _layer("swiglu", GATES[0], "auto")
    assert dropless.resolve_impl("auto", config.experts, num_assignments=8, num_experts=16) == "gather"
    assert dropless.resolve_impl("auto", config.experts, num_assignments=9, num_experts=16) == "bucketed"
    ffn = make_config({"type": "top", "k": 1}, 8, {"type": "ffn", "count_per_node": 4, "hidden_size_per_expert": 8})
    assert dropless.resolve_impl("auto", ffn.experts, 1, 4) == "bucketed"
    with pytest.raises(ValueError, match="gathered"):
        dropless.resolve_impl("gather", ffn.experts)
    with pytest.raises(ValueError, match="dropless_impl"):
        make_config({"type": "top", "k": 1}, 8, EXPERTS["swiglu"], dropless_impl="dense")


@pytest.mark.parametrize("experts", ["swiglu", "gpt_oss", "swiglu_mxfp4"])
def test_bucketed_skipping_idle_experts_equals_ragged(experts, monkeypatch):
    """k*S <= 2E on CPU: the bucketed path runs one expert at a time and skips idle ones; same outputs and
    (float experts) gradients as the ragged path and as the all-experts bucketed path."""
    x = jax.random.normal(jax.random.key(3), (10, 64))  # k*S = 20 <= 2E = 32
    assert dropless.skips_idle_experts(20, 16)
    results = {}
    for impl, skip in (("ragged", False), ("bucketed", True), ("bucketed", False)):
        monkeypatch.setattr(dropless, "skips_idle_experts", lambda a, e, skip=skip: skip)
        config, params = _layer(experts, GATES[0], impl)
        loss = lambda p, x: jnp.sum(moe_apply(p, x, config, capacity_factor=0.0)[0] ** 2)
        y = moe_apply(params, x, config, capacity_factor=0.0)[0]
        g = jax.grad(loss, argnums=(0, 1))(params, x) if "mxfp4" not in experts else None
        results[(impl, skip)] = (np.asarray(y), g)
    ref_y, ref_g = results[("ragged", False)]
    for key in (("bucketed", True), ("bucketed", False)):
        np.testing.assert_allclose(results[key][0], ref_y, rtol=1e-5, atol=1e-5)
        if ref_g is not None:
            for a, b in zip(jax.tree_util.tree_leaves(results[key][1]), jax.tree_util.tree_leaves(ref_g)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_skipping_idle_experts_runs_only_the_used_ones(monkeypatch):
    """The skipping loop runs each used expert once and no idle one: a counting wrapper around the experts sees
    exactly the distinct chosen experts, and NaN weights in every idle expert leave the output finite."""
    import dataclasses

    from tutel_jax.layer import route

    monkeypatch.setattr(dropless, "skips_idle_experts", lambda a, e: True)
    config, params = _layer("swiglu", GATES[0], "bucketed")
    x = jax.random.normal(jax.random.key(5), (3, 64))  # 6 assignments over 16 experts
    plan, _ = route(params["gates"][0], x, config, capacity_factor=0.0)
    used = np.unique(np.asarray(plan.expert_ids))
    ran = []

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def batched(self, p, buf):
            jax.debug.callback(lambda n: ran.append(int(n)), buf.shape[0])
            return self.inner.batched(p, buf)

    counting = dataclasses.replace(config, experts=Counting(config.experts))
    idle = np.setdiff1d(np.arange(16), used)
    poisoned = jax.tree_util.tree_map(lambda a: a.at[idle].set(jnp.nan), params["experts"])
    y = moe_apply({**params, "experts": poisoned}, x, counting, capacity_factor=0.0)[0]
    jax.effects_barrier()
    assert ran == [1] * len(used) and 0 < len(used) < 16
    ref = moe_apply(params, x, config, capacity_factor=0.0)[0]
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-6, atol=1e-6)


def test_crowded_routing_stays_on_the_bucketed_path_on_cpu(monkeypatch):
    """Identical tokens all pick the same experts (count S > the 4x-balanced top bucket): on CPU the ladder
    reaches S for a small [E, S, M] buffer instead of falling back to ragged_dot; same result as ragged."""
    import tutel_jax.layer as layer

    assert dropless.extend_for_cpu((4, 8), 40, 16, 256) == (4, 8, 16, 40)
    assert dropless.extend_for_cpu((4, 8), 40, 16, dropless.CPU_FULL_BUFFER_BYTES) == (4, 8)  # too big
    x = jnp.tile(jax.random.normal(jax.random.key(4), (1, 64)), (40, 1))
    config, params = _layer("swiglu", GATES[0], "ragged")
    ref = np.asarray(moe_apply(params, x, config, capacity_factor=0.0)[0])
    config, params = _layer("swiglu", GATES[0], "bucketed")

    def no_ragged(*args):
        raise AssertionError("the ragged fallback ran")

    monkeypatch.setattr(layer, "_run_ragged", no_ragged)
    got = np.asarray(moe_apply(params, x, config, capacity_factor=0.0)[0])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
