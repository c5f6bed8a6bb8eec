"""Whole MoE layers with modern routers, SwiGLU / GPT-OSS experts and shared experts: outputs and gradients of the
capacity path (nothing dropped), the dropless ragged path and the bucketed dropless path all equal a dense
formulation (every token through every expert, weighted by the reference routing) at float32 tolerance; expert
choice; the aux losses; aux-loss-free bias state in the NNX module; router jitter."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from support import reference_routers_np as ref
from tutel_jax import MoE, init_params, make_config, moe_apply
from tutel_jax.experts import bucket_capacities
from tutel_jax.nn._nnx import RouterState

M, H, E = 16, 12, 8
HP = jax.lax.Precision.HIGHEST

CASES = {
    "mixtral": ({"type": "mixtral", "k": 2}, {"type": "swiglu"}),
    "qwen3_shared_gate": ({"type": "qwen3_moe", "k": 2, "norm_topk_prob": True},
                          {"type": "swiglu", "shared": {"hidden_size": 10, "gate": True}}),
    "deepseek_shared": ({"type": "deepseek_v3", "k": 3, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5},
                        {"type": "swiglu", "shared": {"hidden_size": 10}}),
    "gpt_oss": ({"type": "gpt_oss", "k": 2}, {"type": "gpt_oss", "swiglu_limit": 1.0}),
    "switch": ({"type": "switch"}, {"type": "swiglu"}),
}


def _build(case, **kw):
    gate, experts = CASES[case]
    config = make_config(gate, M, {**experts, "count_per_node": E, "hidden_size_per_expert": H}, **kw)
    params = init_params(config, jax.random.key(0))
    if "e_score_correction_bias" in params["gates"][0]:  # a non-zero bias that changes some choices
        params["gates"][0]["e_score_correction_bias"] = jax.random.normal(jax.random.key(5), (E,)) * 0.2
    return config, params


def _ref_choices(case, params, x):
    """Reference top-k (float64 NumPy) from the float32 logits our gate computes."""
    gate = params["gates"][0]
    logits = np.asarray(x, np.float64) @ np.asarray(gate["weight"], np.float64).T
    if "bias" in gate:
        logits = logits + np.asarray(gate["bias"], np.float64)
    spec = CASES[case][0]
    k = spec.get("k", 1)
    if spec["type"] in ("mixtral", "qwen3_moe", "switch"):
        ids, w = ref.softmax_topk(logits, k, spec["type"] == "mixtral" or spec.get("norm_topk_prob", False))
        probs = ref.softmax(logits)
    elif spec["type"] == "gpt_oss":
        ids, w = ref.topk_softmax(logits, k)
        probs = ref.softmax(logits)
    else:
        ids, w = ref.sigmoid_group_topk(logits, k, np.asarray(gate["e_score_correction_bias"], np.float64),
                                        spec["n_group"], spec["topk_group"], True, spec["routed_scaling_factor"])
        probs = ref.sigmoid(logits) / ref.sigmoid(logits).sum(1, keepdims=True)
    return ids, w, probs


def _all_experts(config, p, x):
    """Every token through every expert, written directly from the formulas: [S, E, M]."""
    if "gate_up_proj_bias" in p:  # GPT-OSS
        ex = config.experts
        h = jnp.einsum("sm,enm->sen", x, p["gate_up_proj"], precision=HP) + p["gate_up_proj_bias"]
        g, u = jnp.minimum(h[..., ::2], ex.swiglu_limit), jnp.clip(h[..., 1::2], -ex.swiglu_limit, ex.swiglu_limit)
        act = (u + 1) * g * jax.nn.sigmoid(ex.swiglu_alpha * g)
        return jnp.einsum("sei,eoi->seo", act, p["down_proj"], precision=HP) + p["down_proj_bias"]
    g = jnp.einsum("sm,eim->sei", x, p["gate_proj"], precision=HP)
    u = jnp.einsum("sm,eim->sei", x, p["up_proj"], precision=HP)
    return jnp.einsum("sei,eoi->seo", jax.nn.silu(g) * u, p["down_proj"], precision=HP)


def _dense_layer(case, config, params, x, chosen):
    """The block as dense math: combine weights from the logits on the reference's chosen experts (a constant
    [S, E] mask), so gradients flow through the router exactly as in the HF formulas."""
    gate, spec = params["gates"][0], CASES[case][0]
    logits = jnp.dot(x, gate["weight"].T, precision=HP) + gate.get("bias", 0.0)
    if spec["type"] == "gpt_oss":
        w = jax.nn.softmax(jnp.where(chosen, logits, -jnp.inf), axis=1)
    elif spec["type"] == "deepseek_v3":
        s = jax.nn.sigmoid(logits) * chosen
        w = s / (s.sum(1, keepdims=True) + 1e-20) * spec["routed_scaling_factor"]
    else:
        w = jax.nn.softmax(logits, axis=1) * chosen
        if spec["type"] == "mixtral" or spec.get("norm_topk_prob"):
            w = w / w.sum(1, keepdims=True)
    y = jnp.einsum("se,seo->so", w, _all_experts(config, params["experts"], x), precision=HP)
    if "shared_experts" in params:
        sp = params["shared_experts"]  # [out, in]
        sh = (jax.nn.silu(jnp.dot(x, sp["gate_proj"].T, precision=HP)) * jnp.dot(x, sp["up_proj"].T, precision=HP))
        sh = jnp.dot(sh, sp["down_proj"].T, precision=HP)
        if "gate" in sp:
            sh = sh * jax.nn.sigmoid(jnp.dot(x, sp["gate"]["weight"].T, precision=HP))
        y = y + sh
    return y


def _assert_tree_close(a, b, what):
    for (path, u), v in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        u, v = np.asarray(u), np.asarray(v)
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5 * max(np.abs(v).max(), 1e-6),
                                   err_msg=f"{what} {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_matches_dense_formula_on_every_path(case):
    config, params = _build(case)
    S = 48
    x = jax.random.normal(jax.random.key(1), (S, M))
    up = jax.random.normal(jax.random.key(2), (S, M))
    ids, w, probs = _ref_choices(case, params, x)
    chosen = jnp.asarray(np.eye(E)[ids].sum(1) > 0)

    def dense(p, x):
        y = _dense_layer(case, config, p, x, chosen)
        return jnp.sum(y * up), y

    (_, yd), gd = jax.jit(jax.value_and_grad(dense, (0, 1), has_aux=True))(params, x)
    big = float(S)  # capacity k * int(S * ceil(S / E)) >= S: nothing drops
    bucketed = dataclasses.replace(config, dropless_impl="bucketed")
    for name, cfg, cf in [("capacity", config, big), ("ragged", config, 0.0), ("bucketed", bucketed, 0.0)]:
        fn = jax.jit(jax.value_and_grad(lambda p, x, cfg=cfg, cf=cf: _loss(p, x, cfg, cf, up), (0, 1), has_aux=True))
        (_, (y, aux)), g = fn(params, x)
        np.testing.assert_allclose(np.asarray(y), np.asarray(yd), rtol=1e-5, atol=1e-5 * np.abs(yd).max(),
                                   err_msg=name)
        _assert_tree_close(g, gd, name)
        assert float(aux.dropped_fraction) == 0.0
        np.testing.assert_array_equal(np.asarray(aux.dispatch_count), np.bincount(ids.ravel(), minlength=E))
    # the routing itself: exact ids (sets per token) and weights; the losses
    assert float(aux.losses["switch"]) == pytest.approx(ref.switch_load_loss(probs, ids), rel=1e-5)
    assert float(aux.losses["seq_aux"]) == pytest.approx(ref.sequence_aux_loss(probs, ids, S), rel=1e-5)
    if "e_score_correction_bias" in params["gates"][0]:  # selection-only bias: no gradient at all
        assert not np.asarray(g[0]["gates"][0]["e_score_correction_bias"]).any()


def _loss(p, x, cfg, cf, up):
    y, aux = moe_apply(p, x, cfg, capacity_factor=cf)
    return jnp.sum(y * up), (y, aux)


def test_bucketed_dropless_overflow_falls_back_to_ragged():
    """All tokens on one expert: beyond the top bucket (4x balance) the bucketed path runs the ragged one."""
    config, params = _build("deepseek_shared")
    params["gates"][0]["e_score_correction_bias"] = jnp.zeros((E,)).at[3].set(10.0)  # everyone picks expert 3
    S = 64
    caps = bucket_capacities(S, E, 1)
    assert caps[-1] < S
    x = jax.random.normal(jax.random.key(3), (S, M))
    bucketed = dataclasses.replace(config, dropless_impl="bucketed")
    y_b, aux = jax.jit(lambda p, x: moe_apply(p, x, bucketed, top_k=1, capacity_factor=0.0))(params, x)
    y_r, _ = jax.jit(lambda p, x: moe_apply(p, x, config, top_k=1, capacity_factor=0.0))(params, x)
    assert int(aux.dispatch_count[3]) == S
    np.testing.assert_allclose(np.asarray(y_b), np.asarray(y_r), rtol=1e-5, atol=1e-6)


def _all_sizes(jaxpr):
    """Element counts of every intermediate, inside cond/switch branches and other sub-jaxprs too."""
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            yield int(np.prod(v.aval.shape)) if hasattr(v.aval, "shape") else 0
        stack = list(eqn.params.values())
        while stack:
            p = stack.pop()
            if isinstance(p, (tuple, list)):
                stack.extend(p)
            elif hasattr(p, "eqns"):
                yield from _all_sizes(p)
            elif hasattr(p, "jaxpr") and hasattr(p.jaxpr, "eqns"):
                yield from _all_sizes(p.jaxpr)


def test_bucketed_dropless_memory_is_bounded():
    config, params = _build("mixtral", dropless_impl="bucketed")
    S = 256  # k*S*M = 8192 rows x M; E*S*M would be 4x that
    x = jnp.zeros((S, M))
    jaxpr = jax.make_jaxpr(jax.grad(lambda p, x: moe_apply(p, x, config, capacity_factor=0.0)[0].sum()))(params, x)
    largest = max(_all_sizes(jaxpr.jaxpr))
    assert largest <= 4 * 2 * S * max(M, 2 * H), largest  # the top bucket: 4x the balanced load


def test_expert_choice_layer_matches_reference():
    config = make_config({"type": "expert_choice", "capacity_factor": 2.0}, M,
                         {"type": "swiglu", "count_per_node": E, "hidden_size_per_expert": H})
    params = init_params(config, jax.random.key(0))
    S = 32
    x = jax.random.normal(jax.random.key(1), (S, M))
    up = jax.random.normal(jax.random.key(2), (S, M))
    logits = np.asarray(x, np.float64) @ np.asarray(params["gates"][0]["weight"], np.float64).T
    probs = ref.softmax(logits)
    C = 8  # floor(2 * 32 / 8)
    picks = ref.expert_choice(probs, C)
    mask = np.zeros((S, E), bool)
    for e in range(E):
        mask[picks[e], e] = True

    def dense(p, x):
        w = jax.nn.softmax(jnp.dot(x, p["gates"][0]["weight"].T, precision=HP), axis=1) * mask
        y = jnp.einsum("se,seo->so", w, _all_experts(config, p["experts"], x), precision=HP)
        return jnp.sum(y * up), y

    (_, y), g = jax.jit(jax.value_and_grad(lambda p, x: _loss(p, x, config, None, up), (0, 1), has_aux=True))(
        params, x)
    (_, yd), gd = jax.jit(jax.value_and_grad(dense, (0, 1), has_aux=True))(params, x)
    np.testing.assert_allclose(np.asarray(y[0]), np.asarray(yd), rtol=1e-5, atol=1e-5 * np.abs(yd).max())
    _assert_tree_close(g, gd, "expert choice")
    np.testing.assert_array_equal(np.asarray(y[1].dispatch_count), [C] * E)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        moe_apply(params, x, config, capacity_factor=0.0)


def test_correction_bias_is_router_state_outside_the_optimizer():
    layer = MoE(gate_type={"type": "deepseek_v3", "k": 2, "n_group": 2, "topk_group": 1}, model_dim=M,
                experts={"type": "swiglu", "count_per_node": E, "hidden_size_per_expert": H,
                         "shared": {"hidden_size": 8}}, rngs=nnx.Rngs(0))
    layer.eval()
    assert isinstance(layer.params["gates"][0]["e_score_correction_bias"], RouterState)
    trainable = jax.tree.leaves(nnx.state(layer, nnx.Param))
    assert len(trainable) == 1 + 3 + 3  # router weight, routed experts (3), shared experts (3)
    optimizer = nnx.Optimizer(layer, optax.sgd(1.0), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(1), (64, M))

    @nnx.jit
    def step(layer, optimizer, x):
        def loss(layer):
            return jnp.sum(layer(x) ** 2) + layer.l_aux
        grads = nnx.grad(loss)(layer)
        optimizer.update(layer, grads)

    before = np.asarray(layer.params["gates"][0]["e_score_correction_bias"][...])
    step(layer, optimizer, x)
    np.testing.assert_array_equal(np.asarray(layer.params["gates"][0]["e_score_correction_bias"][...]), before)
    layer(x)
    counts = np.asarray(layer.dispatch_count)
    layer.update_correction_bias(0.01)
    bias = np.asarray(layer.params["gates"][0]["e_score_correction_bias"][...])
    np.testing.assert_allclose(bias, before + 0.01 * np.sign(counts.mean() - counts), rtol=1e-6, atol=1e-8)
    assert (bias[counts > counts.mean()] < 0).all()
    plain = MoE(gate_type={"type": "mixtral"}, model_dim=M,
                experts={"type": "swiglu", "count_per_node": 2, "hidden_size_per_expert": 4})
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        plain.update_correction_bias(0.1)


def test_router_jitter_only_in_training():
    kw = dict(model_dim=M, experts={"type": "swiglu", "count_per_node": E, "hidden_size_per_expert": H})
    layer = MoE(gate_type={"type": "mixtral", "k": 2, "jitter": 0.5}, rngs=nnx.Rngs(0), **kw)
    plain = MoE(gate_type={"type": "mixtral", "k": 2}, rngs=nnx.Rngs(0), **kw)
    x = jax.random.normal(jax.random.key(1), (64, M))
    a, b = layer(x), layer(x)
    assert not np.allclose(np.asarray(a), np.asarray(b))  # fresh jitter each call
    layer.eval()
    np.testing.assert_allclose(np.asarray(layer(x)), np.asarray(plain(x, deterministic=True)), rtol=1e-6)
    config, params = _build("mixtral")
    with pytest.raises(ValueError, match="rng"):
        moe_apply(params, x, make_config({"type": "mixtral", "gate_noise": 1.0}, M, kw["experts"]),
                  deterministic=False)
