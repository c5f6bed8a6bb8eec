"""The fused gating kernel (`pallas_kernels.gating`, through Pallas' CPU interpreter) inside the router gates'
routing: with `kernel_backend` set, Qwen3-MoE, Mixtral, Switch and DeepSeek-V3 routers get identical plans
(expert ids, slots, counts, capacity), the same combine weights, losses and gradients as the plain path, on the
capacity path with drops, dropless and bounded capacity, with and without batch-prioritized routing. GPT-OSS,
expert choice and padded (valid-masked) calls fall back to the plain path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from tutel_jax import init_params, make_config, moe_apply, route
from tutel_jax.routing._routers import DeepSeekV3Router, GptOssRouter, MixtralRouter, softmax_topk, topk_softmax

M, E, S = 16, 8, 32
EXPERTS = {"type": "swiglu", "count_per_node": E, "hidden_size_per_expert": 8}

ROUTERS = {
    "qwen3": {"type": "qwen3_moe", "k": 2},
    "qwen3_norm": {"type": "qwen3_moe", "k": 2, "norm_topk_prob": True},
    "mixtral": {"type": "mixtral", "k": 2},
    "switch": {"type": "switch"},
    "deepseek_grouped": {"type": "deepseek_v3", "k": 3, "n_group": 4, "topk_group": 2,
                         "routed_scaling_factor": 2.5},
    "deepseek_plain": {"type": "deepseek_v3", "k": 2, "norm_topk_prob": False, "correction_bias": False},
    # DeepSeek's own -inf for dropped groups, with k = the kept experts
    "deepseek_masked": {"type": "deepseek_v3", "k": 4, "n_group": 4, "topk_group": 2,
                        "group_mask_value": float("-inf")},
}
# (router, top_k, capacity_factor, batch_prioritized_routing): every router with and without priority, k 1..4,
# fixed capacity with drops (cf > 0), dropless (cf = 0) and bounded (cf < 0)
CASES = [
    ("qwen3", 2, 0.5, False), ("qwen3", 3, 0.0, True),
    ("qwen3_norm", 1, -0.5, False), ("qwen3_norm", 4, 0.5, True),
    ("mixtral", 2, 0.0, False), ("mixtral", 1, 0.5, True),
    ("switch", 1, 0.5, False), ("switch", 1, -0.5, True),
    ("deepseek_grouped", 3, 0.5, False), ("deepseek_grouped", 4, 0.0, True),
    ("deepseek_plain", 2, -0.5, False), ("deepseek_plain", 1, 1.0, True),
    ("deepseek_masked", 4, 0.5, True),
]


@pytest.fixture
def gating_calls(monkeypatch):
    """Counts the traced calls of `pallas_kernels.gating` (the layer looks it up at call time)."""
    calls = []
    real = pallas_kernels.gating

    def counting(*args, **kwargs):
        calls.append(kwargs.get("implementation"))
        return real(*args, **kwargs)

    monkeypatch.setattr(pallas_kernels, "gating", counting)
    return calls


def _build(gate: dict, bpr: bool = False):
    """(plain config, kernel config, params) with exact logit ties: experts 6 and 3 copy the weight rows of
    experts 1 (another group) and 2 (the same group), so the tie rule matters."""
    kwargs = dict(gate_type=gate, model_dim=M, experts=EXPERTS, batch_prioritized_routing=bpr)
    plain, kernel = make_config(**kwargs), make_config(**kwargs, kernel_backend="interpret")
    params = init_params(plain, jax.random.key(0))
    g = params["gates"][0]
    g["weight"] = g["weight"].at[6].set(g["weight"][1]).at[3].set(g["weight"][2])
    if "e_score_correction_bias" in g:  # a non-zero bias that changes some choices (equal on the tied pairs)
        bias = jax.random.normal(jax.random.key(5), (E,)) * 0.2
        g["e_score_correction_bias"] = bias.at[6].set(bias[1]).at[3].set(bias[2])
    return plain, kernel, params


def _route_fn(config, k, cf, r):
    """jit(value_and_grad) of a scalar of the plan's weights and the aux loss, w.r.t. gate params and x."""
    def fn(gate_params, x):
        plan, l_aux, losses = route(gate_params, x, config, top_k=k, capacity_factor=cf, return_losses=True)
        return jnp.sum(plan.gates * r) + 0.1 * l_aux, (plan, l_aux, losses)
    return jax.jit(jax.value_and_grad(fn, (0, 1), has_aux=True))


def _assert_grads_close(actual, expected, rtol=1e-5):
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree.leaves(expected)):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * max(np.abs(b).max(), 1e-30),
                                   err_msg=jax.tree_util.keystr(path))


def _assert_same_plan(p1, p0):
    for name in ("expert_ids", "locations", "dispatch_count", "capacity"):
        np.testing.assert_array_equal(np.asarray(getattr(p1, name)), np.asarray(getattr(p0, name)), err_msg=name)
    assert p1.buffer_capacity == p0.buffer_capacity
    np.testing.assert_allclose(np.asarray(p1.gates), np.asarray(p0.gates), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name,k,cf,bpr", CASES)
def test_kernel_routing_matches_plain(name, k, cf, bpr, gating_calls):
    plain, kernel, params = _build(ROUTERS[name], bpr)
    x = jax.random.normal(jax.random.key(1), (S, M))
    r = jax.random.normal(jax.random.key(2), (k, S))
    (_, (p0, l0, losses0)), g0 = _route_fn(plain, k, cf, r)(params["gates"][0], x)
    assert gating_calls == []  # the plain path never calls the kernel
    (_, (p1, l1, losses1)), g1 = _route_fn(kernel, k, cf, r)(params["gates"][0], x)
    assert gating_calls == ["interpret"]  # the kernel really chose
    _assert_same_plan(p1, p0)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6, atol=1e-7)
    assert sorted(losses1) == sorted(losses0)
    for key in losses0:
        np.testing.assert_allclose(float(losses1[key]), float(losses0[key]), rtol=1e-6, atol=1e-7, err_msg=key)
    _assert_grads_close(g1, g0)
    if cf > 0 and k == 1:  # 2 slots per expert for 32 tokens: some assignments must drop
        assert float(p0.dropped_fraction) > 0
    if cf == 0:
        assert float(p0.dropped_fraction) == 0


def test_ties_go_to_the_lower_expert():
    """Every expert but 5 has the same weight row (exact ties for every token): both paths take the lower ids."""
    plain, kernel, params = _build(ROUTERS["mixtral"])
    g = params["gates"][0]
    g["weight"] = g["weight"].at[:].set(g["weight"][2]).at[5].set(g["weight"][2] * 1.5)  # all tied but one
    x = jnp.abs(jax.random.normal(jax.random.key(1), (S, M)))
    p0, _ = jax.jit(lambda g, x: route(g, x, plain, top_k=3))(g, x)
    p1, _ = jax.jit(lambda g, x: route(g, x, kernel, top_k=3))(g, x)
    _assert_same_plan(p1, p0)
    rows = {tuple(c) for c in np.asarray(p0.expert_ids).T.tolist()}
    assert rows <= {(5, 0, 1), (0, 1, 2)} and len(rows) == 2, rows  # expert 5 first or last, the rest tied


@pytest.mark.parametrize("name,cf,bpr", [("deepseek_grouped", 0.75, True), ("qwen3_norm", 0.0, False)])
def test_layer_outputs_and_gradients_match_plain(name, cf, bpr, gating_calls):
    plain, kernel, params = _build(ROUTERS[name], bpr)
    x = jax.random.normal(jax.random.key(3), (2, S // 2, M))
    up = jax.random.normal(jax.random.key(4), x.shape)

    def loss(config):
        def fn(p, x):
            y, aux = moe_apply(p, x, config, capacity_factor=cf)
            return jnp.sum(y * up) + 0.1 * aux.l_aux, (y, aux)
        return jax.jit(jax.value_and_grad(fn, (0, 1), has_aux=True))

    (_, (y0, aux0)), g0 = loss(plain)(params, x)
    (_, (y1, aux1)), g1 = loss(kernel)(params, x)
    assert gating_calls == ["interpret"]
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y0), rtol=1e-6, atol=1e-6 * np.abs(y0).max())
    np.testing.assert_allclose(float(aux1.l_aux), float(aux0.l_aux), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(aux1.dispatch_count), np.asarray(aux0.dispatch_count))
    assert float(aux1.dropped_fraction) == float(aux0.dropped_fraction)
    _assert_grads_close(g1, g0)
    if "e_score_correction_bias" in params["gates"][0]:  # the selection bias still gets no gradient
        assert not np.asarray(g1[0]["gates"][0]["e_score_correction_bias"]).any()


def test_expert_choice_falls_back(gating_calls):
    plain, kernel, params = _build({"type": "expert_choice", "capacity_factor": 2.0})
    x = jax.random.normal(jax.random.key(1), (S, M))
    y0, aux0 = jax.jit(lambda p, x: moe_apply(p, x, plain))(params, x)
    y1, aux1 = jax.jit(lambda p, x: moe_apply(p, x, kernel))(params, x)
    assert gating_calls == []
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y0), rtol=1e-6, atol=1e-6 * np.abs(y0).max())
    np.testing.assert_array_equal(np.asarray(aux1.dispatch_count), np.asarray(aux0.dispatch_count))


def test_gpt_oss_falls_back(gating_calls):
    plain, kernel, params = _build({"type": "gpt_oss", "k": 2}, bpr=True)
    x = jax.random.normal(jax.random.key(1), (S, M))
    p0, l0 = jax.jit(lambda g, x: route(g, x, plain, capacity_factor=0.5))(params["gates"][0], x)
    p1, l1 = jax.jit(lambda g, x: route(g, x, kernel, capacity_factor=0.5))(params["gates"][0], x)
    assert gating_calls == []
    _assert_same_plan(p1, p0)
    assert float(l1) == float(l0)


def test_padding_mask_falls_back(gating_calls):
    plain, kernel, params = _build(ROUTERS["deepseek_grouped"])
    x = jax.random.normal(jax.random.key(1), (S, M))
    valid = jnp.arange(S) < S - 5
    p0, _ = jax.jit(lambda g, x: route(g, x, plain, valid=valid, capacity_factor=1.0))(params["gates"][0], x)
    p1, _ = jax.jit(lambda g, x: route(g, x, kernel, valid=valid, capacity_factor=1.0))(params["gates"][0], x)
    assert gating_calls == []
    _assert_same_plan(p1, p0)


def test_gpt_oss_top_k_of_logits_is_not_top_k_of_softmax():
    """Why GPT-OSS falls back: two different logits can round to the same probability (here both underflow
    to 0), and the kernel then takes the lower index where the router takes the larger logit."""
    logits = jnp.array([[0.0, -150.0, -120.0, -5.0]])
    router = topk_softmax(logits, 3).expert_ids[:, 0]
    fused = pallas_kernels.gating_reference(logits, 3, normalize=True).expert_ids[:, 0]
    assert list(router) == [0, 3, 2] and list(fused) == [0, 3, 1]
    assert GptOssRouter(k=3).kernel_gating({}, 3, 4) is None


def test_deepseek_kernel_gating_description():
    params = {"weight": jnp.zeros((E, M)), "e_score_correction_bias": jnp.arange(E, dtype=jnp.float32)}
    spec = DeepSeekV3Router(k=3, n_group=4, topk_group=2, routed_scaling_factor=2.5).kernel_gating(params, 3, E)
    assert spec["score_fn"] == "sigmoid" and spec["n_group"] == 4 and spec["topk_group"] == 2
    assert spec["routed_scaling_factor"] == 2.5 and spec["normalize"] and spec["group_fill_value"] == 0.0
    np.testing.assert_array_equal(np.asarray(spec["correction_bias"]), np.arange(E))
    # cases the kernel could choose differently (or `select` raises): the plain path
    assert DeepSeekV3Router(n_group=8, topk_group=2).kernel_gating(params, 2, E) is None  # groups of one
    assert DeepSeekV3Router(n_group=3).kernel_gating(params, 2, E) is None  # does not divide E
    assert DeepSeekV3Router().kernel_gating(params, E + 1, E) is None  # k > E
    masked = DeepSeekV3Router(n_group=4, topk_group=2, group_mask_value=-jnp.inf)
    assert masked.kernel_gating(params, 4, E) is not None  # k <= kept experts (2 groups of 2)
    assert masked.kernel_gating(params, 5, E) is None
    assert DeepSeekV3Router(n_group=4, topk_group=2, group_mask_value=float("nan")).kernel_gating(
        params, 2, E) is None


def test_subclass_with_its_own_select_is_not_described():
    class Reversed(MixtralRouter):
        def select(self, params, logits, k):
            return softmax_topk(-logits, k, True)

    params = {"weight": jnp.zeros((E, M))}
    assert MixtralRouter().kernel_gating(params, 2, E) == {"score_fn": "softmax", "normalize": True}
    assert Reversed().kernel_gating(params, 2, E) is None


def test_tutel_gates_and_routers_share_one_kernel_helper(monkeypatch, gating_calls):
    """The fused gating kernel is called from one place (`routing.pipeline.kernel_choices`) for Tutel's gates and
    the routers alike; Tutel's top gate gets the plain path's plan and weights through it."""
    from tutel_jax.routing import _pipeline as pipeline
    used = []
    real = pipeline.kernel_choices

    def counting(*args, **kwargs):
        used.append(kwargs["batch_prioritized_routing"])
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "kernel_choices", counting)
    x = jax.random.normal(jax.random.key(1), (S, M))
    top = dict(gate_type={"type": "top", "k": 2, "capacity_factor": 0.5}, model_dim=M, experts=EXPERTS,
               batch_prioritized_routing=True)
    top_configs = make_config(**top), make_config(**top, kernel_backend="interpret")
    for plain, kernel, params in ((*top_configs, init_params(top_configs[0], jax.random.key(0))),
                                  _build(ROUTERS["mixtral"])):
        p0, l0 = route(params["gates"][0], x, plain)
        p1, l1 = route(params["gates"][0], x, kernel)
        _assert_same_plan(p1, p0)
        np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6, atol=1e-7)
    assert used == [True, False] and gating_calls == ["interpret", "interpret"]
