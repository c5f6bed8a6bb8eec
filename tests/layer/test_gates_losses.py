"""Gates (top, cosine_top, several per layer, noise) and losses (GShard, importance+load) against float64 NumPy."""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import reference_np as ref
from tutel_jax import init_params, make_config, moe_apply, route
from tutel_jax.core._losses import cv_squared, gshard_loss, load_importance_loss
from tutel_jax.routing import CosineTopGate, TopGate, MixtralRouter

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


# -- the gate protocol: one routing pipeline, legacy custom gates through `GateAdapter` ---------------------------

def _bits(tree):
    return [np.asarray(a).tobytes() for a in jax.tree_util.tree_leaves(tree)]


class _ComputedBy:
    """init and logits of a custom gate computed by a built-in gate class, `computed_by` (no Gate base class)."""
    computed_by: typing.ClassVar[type] = TopGate

    def init(self, key, model_dim, num_experts, dtype):
        return self.computed_by().init(key, model_dim, num_experts, dtype)

    def logits(self, params, x):
        return self.computed_by().logits(params, x)


@dataclasses.dataclass(frozen=True)
class _LegacyTop(_ComputedBy):
    """A custom gate written against the original protocol only (k, capacity_factor, gate_noise, init, logits):
    Tutel's top gate, computed by `TopGate`."""
    k: int = 2
    capacity_factor: float = 1.0
    gate_noise: float = 0.0
    tag = "legacy"  # a plain attribute of the custom gate


@dataclasses.dataclass(frozen=True)
class _LegacyRouter(_LegacyTop):
    """A duck-typed router (no base class): select, jitter, aux_loss and z_loss_weight, as Mixtral's."""
    jitter: float = 0.0
    aux_loss: str = "switch"
    z_loss_weight: float = 0.0
    capacity_factor: float = 0.0

    computed_by: typing.ClassVar[type] = MixtralRouter

    def select(self, params, logits, k):
        from tutel_jax.routing._routers import softmax_topk
        return softmax_topk(logits, k, True)


def test_gate_selection_is_declared_not_probed():
    from tutel_jax.routing import Gate, GateAdapter, as_gate, make_gate
    from tutel_jax.routing._gates import PLAN, SELECT, TUTEL
    from tutel_jax.routing import ExpertChoiceRouter, MixtralRouter
    assert TopGate().selection == CosineTopGate().selection == TUTEL
    assert MixtralRouter().selection == SELECT and ExpertChoiceRouter().selection == PLAN
    for gate in (TopGate(), MixtralRouter(), ExpertChoiceRouter()):
        assert make_gate(gate) is gate and as_gate(gate) is gate

    @dataclasses.dataclass(frozen=True)
    class NewStyle(Gate):  # a subclass: defaults for everything but its own members; `select` makes it a router
        k: int = 1
        capacity_factor: float = 1.0

        def init(self, key, model_dim, num_experts, dtype):
            return {}

        def logits(self, params, x):
            return x[:, :E]

        def select(self, params, logits, k):
            return MixtralRouter().select(params, logits, k)

    gate = NewStyle()
    assert gate.selection == SELECT and gate.jitter == 0.0 and gate.gate_noise == 0.0
    assert gate.kernel_gating({}, 1, E) is None and gate.aux_loss is None and gate.z_loss_weight == 0.0
    legacy = make_gate(_LegacyTop())
    assert isinstance(legacy, GateAdapter) and isinstance(legacy, Gate) and legacy.selection == TUTEL
    assert (legacy.k, legacy.capacity_factor, legacy.gate_noise, legacy.jitter) == (2, 1.0, 0.0, 0.0)
    assert make_gate(legacy) is legacy and legacy == make_gate(_LegacyTop()) and hash(legacy) == hash(make_gate(_LegacyTop()))
    router = make_gate(_LegacyRouter(jitter=0.25))
    assert router.selection == SELECT and router.jitter == 0.25 and router.aux_loss == "switch"
    assert router.kernel_gating({}, 2, E) is None  # the wrapped gate has none
    assert router.needs_rng and not legacy.needs_rng and make_gate({"type": "top", "gate_noise": 1.0}).needs_rng
    with pytest.raises(ValueError, match="must be a dict"):
        make_gate(object())


def test_legacy_gate_adapter_fields_follow_dataclasses_replace():
    from tutel_jax.runtime._reconfigure import with_gate_defaults
    config = make_config(_LegacyTop(), M, EXPERTS)
    replaced = with_gate_defaults(config, 1, 0.5).gates[0]
    assert (replaced.k, replaced.capacity_factor) == (1, 0.5)
    assert replaced.gate == _LegacyTop(k=1, capacity_factor=0.5)  # the wrapped dataclass gate follows
    assert replaced.tag == "legacy"  # other attributes read through to the wrapped gate
    assert dataclasses.replace(config.gates[0], gate_noise=2.0).gate.gate_noise == 2.0


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("is_gshard_loss", [True, False])
def test_legacy_custom_gate_routes_exactly_like_the_builtin(train, is_gshard_loss):
    """A custom gate on the original 2-method protocol is routed like Tutel's top gate, bit for bit (noise,
    normalize_gate, both losses), and reports the same (empty) losses."""
    kw = dict(is_gshard_loss=is_gshard_loss, normalize_gate=False, batch_prioritized_routing=True)
    builtin = make_config({"type": "top", "k": 2, "gate_noise": 1.0}, M, EXPERTS, **kw)
    legacy = make_config(_LegacyTop(k=2, gate_noise=1.0), M, EXPERTS, **kw)
    params = init_params(builtin, jax.random.key(0))
    x = jnp.asarray(_x(32, 4))
    rng = jax.random.key(2) if train else None
    a = route(params["gates"][0], x, builtin, rng=rng, deterministic=not train, return_losses=True)
    b = route(params["gates"][0], x, legacy, rng=rng, deterministic=not train, return_losses=True)
    assert a[2] == b[2] == {}
    assert _bits(a) == _bits(b)
    ya, auxa = moe_apply(params, x, builtin, rng=rng, deterministic=not train)
    yb, auxb = moe_apply(params, x, legacy, rng=rng, deterministic=not train)
    assert _bits((ya, auxa)) == _bits((yb, auxb))


def test_legacy_duck_router_routes_exactly_like_mixtral():
    spec = dict(k=2, gate_noise=1.0, jitter=0.2, aux_loss="gshard", z_loss_weight=0.01)
    builtin = make_config({"type": "mixtral", **spec}, M, EXPERTS)
    legacy = make_config(_LegacyRouter(**spec), M, EXPERTS)
    params = init_params(builtin, jax.random.key(0))
    x = jnp.asarray(_x(32, 5))
    fn = lambda c: jax.jit(lambda g, x, r: route(g, x, c, rng=r, deterministic=False, return_losses=True))
    a = fn(builtin)(params["gates"][0], x, jax.random.key(3))
    b = fn(legacy)(params["gates"][0], x, jax.random.key(3))
    assert sorted(a[2]) == sorted(b[2]) == ["gshard", "seq_aux", "switch", "z_loss"]
    assert _bits(a) == _bits(b)


def test_zero_losses_keys_match_the_routed_losses():
    from tutel_jax.routing import zero_losses
    x = jnp.asarray(_x(16, 6))
    specs = [{"type": "top", "k": 2}, {"type": "cosine_top", "k": 1, "proj_dim": 8}, _LegacyTop(),
             {"type": "qwen3_moe", "k": 2}, {"type": "deepseek_v3", "k": 2}, {"type": "gpt_oss", "k": 2},
             {"type": "expert_choice"}, _LegacyRouter()]
    expected = [(), (), (), ("gshard", "seq_aux", "switch", "z_loss"), ("gshard", "seq_aux", "switch", "z_loss"),
                ("gshard", "seq_aux", "switch", "z_loss"), ("z_loss",), ("gshard", "seq_aux", "switch", "z_loss")]
    for spec, names in zip(specs, expected):
        config = make_config(spec, M, EXPERTS)
        params = init_params(config, jax.random.key(0))
        _, _, losses = route(params["gates"][0], x, config, return_losses=True)
        assert tuple(sorted(losses)) == tuple(sorted(zero_losses(config.gates[0]))) == names, spec
        _, aux = moe_apply(params, jnp.zeros((0, M)), config)
        assert tuple(sorted(aux.losses)) == names


def test_legacy_expert_choice_gate_keeps_its_fixed_capacity_check():
    from tutel_jax.routing import ExpertChoiceRouter

    @dataclasses.dataclass(frozen=True)
    class LegacyExpertChoice(_ComputedBy):  # duck-typed: `plan` makes it an expert-choice gate
        k: int = 1
        capacity_factor: float = 2.0
        gate_noise: float = 0.0
        computed_by: typing.ClassVar[type] = ExpertChoiceRouter

        def plan(self, params, logits, capacity_factor, **kw):
            return ExpertChoiceRouter().plan(params, logits, capacity_factor, **kw)

    legacy = make_config(LegacyExpertChoice(), M, EXPERTS)
    builtin = make_config({"type": "expert_choice"}, M, EXPERTS)
    params = init_params(builtin, jax.random.key(0))
    x = jnp.asarray(_x(24, 7))
    a = route(params["gates"][0], x, builtin, return_losses=True)
    b = route(params["gates"][0], x, legacy, return_losses=True)
    assert _bits(a) == _bits(b)
    with pytest.raises(ValueError, match="fixed capacity"):
        moe_apply(params, x, legacy, capacity_factor=0.0)
