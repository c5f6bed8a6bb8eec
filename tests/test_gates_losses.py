"""Gates (top, cosine_top, several per layer, noise) and losses (GShard, importance+load) against float64 NumPy."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference_np as ref
from tutel_jax import init_params, make_config, moe_apply, route
from tutel_jax.losses import cv_squared, gshard_loss, load_importance_loss
from tutel_jax.routing.gates import CosineTopGate, TopGate

M, E = 16, 6
EXPERTS = {"type": "ffn", "count_per_node": E, "hidden_size_per_expert": 8}


def _x(S=40, seed=0):
    return np.random.default_rng(seed).normal(size=(S, M)).astype(np.float32)


def test_cosine_gate_logits_match_reference():
    gate = CosineTopGate(k=2, proj_dim=12, init_t=0.3, fp32_gate=True)
    params = gate.init(jax.random.key(0), M, E, jnp.float32)
    assert params["sim_matrix"].shape == (12, E) and params["cosine_projector"]["weight"].shape == (12, M)
    np.testing.assert_allclose(np.asarray(params["temperature"]), [np.log(1 / 0.3)], rtol=1e-6)
    x = _x()
    got = gate.logits(params, jnp.asarray(x))
    p = {"w": params["cosine_projector"]["weight"], "b": params["cosine_projector"]["bias"],
         "s": params["sim_matrix"], "t": params["temperature"]}
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    want = ref.cosine_logits(x.astype(np.float64), p["w"], p["b"], p["s"], p["t"])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    # the temperature is clamped at ln(100)
    hot = dict(params, temperature=jnp.asarray([10.0]))
    want_hot = ref.cosine_logits(x.astype(np.float64), p["w"], p["b"], p["s"], np.array([10.0]))
    np.testing.assert_allclose(np.asarray(gate.logits(hot, jnp.asarray(x))), want_hot, rtol=1e-5, atol=1e-4)


def test_cosine_gate_layer_end_to_end_matches_reference():
    config = make_config({"type": "cosine_top", "k": 2, "proj_dim": 10, "fp32_gate": True}, M, EXPERTS)
    params = init_params(config, jax.random.key(3))
    x = _x(48, 4)
    y, aux = moe_apply(params, jnp.asarray(x), config)
    gp = params["gates"][0]
    logits = ref.cosine_logits(x.astype(np.float64), *(np.asarray(a, np.float64) for a in (
        gp["cosine_projector"]["weight"], gp["cosine_projector"]["bias"], gp["sim_matrix"], gp["temperature"])))
    y_ref, l_ref, _ = ref.layer(x, {k: np.asarray(v) for k, v in params["experts"].items()}, 2, 1.0, logits=logits)
    np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(aux.l_aux), l_ref, rtol=1e-5)


def test_gshard_loss_reference():
    scores = ref.softmax(np.random.default_rng(1).normal(size=(30, E)))
    ids = np.argmax(scores, axis=1)
    got = gshard_loss(jnp.asarray(scores, jnp.float32), jnp.asarray(ids[None]))
    np.testing.assert_allclose(float(got), ref.gshard_loss(scores, ids), rtol=1e-6)


def test_cv_squared_uses_ddof_1():
    v = np.array([1.0, 2.0, 4.0, 7.0])
    np.testing.assert_allclose(float(cv_squared(jnp.asarray(v))), np.var(v, ddof=1) / (np.mean(v) ** 2 + 1e-10),
                               rtol=1e-6)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_importance_load_loss_with_noise_matches_reference(k):
    noise_scale = 1.0
    config = make_config({"type": "top", "k": k, "gate_noise": noise_scale}, M, EXPERTS, is_gshard_loss=False)
    params = init_params(config, jax.random.key(5))
    x = _x(64, 6)
    key = jax.random.key(9)
    plan, l_aux = route(params["gates"][0], jnp.asarray(x), config, rng=key, deterministic=False)
    # the same noise the layer drew: normal(key, [S, E]) * gate_noise / E
    noise = np.asarray(jax.random.normal(key, (64, E), jnp.float32), np.float64)
    logits = x.astype(np.float64) @ np.asarray(params["gates"][0]["wg"]["weight"], np.float64).T
    noisy = logits + noise_scale * noise / E
    ids, *_ = ref.route(ref.softmax(noisy), k, 1.0)
    np.testing.assert_array_equal(np.asarray(plan.expert_ids), ids)
    top_noisy = np.take_along_axis(noisy, ids.T, axis=1)
    want = ref.load_importance_loss(ref.softmax(logits), top_noisy, E, noise_scale)
    np.testing.assert_allclose(float(l_aux), want, rtol=1e-4)
    # and it is differentiable
    g = jax.grad(lambda p: route(p, jnp.asarray(x), config, rng=key, deterministic=False)[1])(params["gates"][0])
    assert np.isfinite(np.asarray(g["wg"]["weight"])).all() and np.abs(np.asarray(g["wg"]["weight"])).max() > 0


def test_importance_loss_needs_noise():
    with pytest.raises(ValueError, match="gate_noise"):
        load_importance_loss(jnp.ones((4, 2)) / 2, jnp.ones((4, 1)), 2, 0.0)


def test_gate_noise_only_in_training_and_needs_rng():
    config = make_config({"type": "top", "k": 1, "gate_noise": 5.0}, M, EXPERTS)
    params = init_params(config, jax.random.key(0))
    x = jnp.asarray(_x(200, 2))
    clean, _ = route(params["gates"][0], x, config, deterministic=True)
    noisy, _ = route(params["gates"][0], x, config, rng=jax.random.key(1), deterministic=False)
    same, _ = route(params["gates"][0], x, config, rng=jax.random.key(1), deterministic=False)
    assert (np.asarray(clean.expert_ids) != np.asarray(noisy.expert_ids)).any()
    np.testing.assert_array_equal(np.asarray(noisy.expert_ids), np.asarray(same.expert_ids))
    with pytest.raises(ValueError, match="rng"):
        route(params["gates"][0], x, config, deterministic=False)


def test_several_gates_selected_per_call():
    config = make_config([{"type": "top", "k": 1}, {"type": "top", "k": 2, "capacity_factor": 0.5}], M, EXPERTS)
    params = init_params(config, jax.random.key(0))
    assert len(params["gates"]) == 2
    x = jnp.asarray(_x(24, 1))
    y0, aux0 = moe_apply(params, x, config, gate_index=0)
    y1, aux1 = moe_apply(params, x, config, gate_index=1)
    assert int(aux0.dispatch_count.sum()) == 24 and int(aux1.dispatch_count.sum()) == 48
    assert int(aux1.capacity) == 2 * int(0.5 * 4)
    swapped = dict(params, gates=[params["gates"][1], params["gates"][0]])
    y_swapped, _ = moe_apply(swapped, x, config, gate_index=0)  # gate 0's settings with gate 1's weights
    assert not np.allclose(np.asarray(y0), np.asarray(y_swapped))
    with pytest.raises(ValueError, match="gate_index"):
        moe_apply(params, x, config, gate_index=2)


def test_seeds_give_gate_i_seed_plus_i():
    config = make_config([{"type": "top", "k": 1}, {"type": "top", "k": 1}], M, EXPERTS)
    a = init_params(config, seeds=(3, 4))
    b = init_params(dataclasses.replace(config, gates=config.gates[:1]), seeds=(4, 4))
    np.testing.assert_array_equal(np.asarray(a["gates"][1]["wg"]["weight"]), np.asarray(b["gates"][0]["wg"]["weight"]))


def test_fp32_gate_with_bfloat16_layer():
    config = make_config({"type": "top", "k": 2, "fp32_gate": True}, M, EXPERTS, dtype="bfloat16")
    params = init_params(config, jax.random.key(0))
    assert params["gates"][0]["wg"]["weight"].dtype == jnp.float32
    assert params["experts"]["batched_fc1_w"].dtype == jnp.bfloat16
    x = jnp.asarray(_x(16, 3), jnp.bfloat16)
    plan, _ = route(params["gates"][0], x, config)
    assert plan.gates.dtype == jnp.float32
    y, _ = moe_apply(params, x, config)
    assert y.dtype == jnp.bfloat16 and y.shape == x.shape


def test_top_gate_init_bound():
    w = TopGate().init(jax.random.key(0), 64, 8, jnp.float32)["wg"]["weight"]
    assert w.shape == (8, 64) and float(jnp.abs(w).max()) <= 1 / 8
