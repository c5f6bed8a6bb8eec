"""Every Tutel oracle case: load `state_dict.pt` through the importer, run the fixture input, match Tutel.

Tolerances (fixtures README): routing exactly; outputs/intermediates rtol=atol=1e-5; l_aux atol 1e-6;
gradients per tensor rtol 1e-5, atol 1e-5 * max|expected|.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tutel_jax import fast_decode, fast_encode, moe, moe_apply, route


def _load_layer(case):
    layer = moe.moe_layer(**case.layer_kwargs(), seeds=(1, 2, 3))
    layer.load_state_dict(case.dir / "state_dict.pt")
    return layer


def test_routing_matches_tutel_exactly(tutel_case):
    layer = _load_layer(tutel_case)
    x = jnp.asarray(tutel_case.array("input")).reshape(-1, layer.config.model_dim)
    plan, l_aux = route(layer.param_tree()["gates"][0], x, layer.config)
    np.testing.assert_array_equal(np.asarray(plan.expert_ids).T, tutel_case.array("topk_ids"))
    np.testing.assert_array_equal(np.asarray(plan.locations), tutel_case.array("locations"))
    np.testing.assert_array_equal(np.asarray(plan.dispatch_count), tutel_case.array("dispatch_count"))
    assert int(plan.capacity) == int(tutel_case.array("capacity")) == tutel_case.meta["capacity"]
    dropped = int(np.sum(~np.asarray(plan.kept)))
    assert dropped == tutel_case.meta["dropped_assignments"]
    np.testing.assert_allclose(np.asarray(plan.gates), tutel_case.array("gates"), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(l_aux), float(tutel_case.array("l_aux")), rtol=0, atol=1e-6)


def test_intermediates_match_tutel(tutel_case):
    layer = _load_layer(tutel_case)
    params = layer.param_tree()
    x = jnp.asarray(tutel_case.array("input")).reshape(-1, layer.config.model_dim)
    gate = layer.config.gates[0]
    logits = gate.logits(params["gates"][0], x)
    np.testing.assert_allclose(np.asarray(logits), tutel_case.array("logits"), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.nn.softmax(logits, axis=1)), tutel_case.array("scores"),
                               rtol=1e-5, atol=1e-5)
    plan, _ = route(params["gates"][0], x, layer.config)
    capacity = int(plan.capacity)
    plan = plan.with_buffer_capacity(capacity)  # dropless cases: lay out the exact Tutel buffer
    buf = fast_encode(x, plan, layer.config.is_postscore)
    np.testing.assert_allclose(np.asarray(buf), tutel_case.array("dispatched"), rtol=1e-5, atol=1e-5)
    out = layer.config.experts.batched(params["experts"], buf)
    np.testing.assert_allclose(np.asarray(out), tutel_case.array("expert_out"), rtol=1e-5, atol=1e-5)
    y = fast_decode(out, plan, layer.config.is_postscore)
    np.testing.assert_allclose(np.asarray(y).reshape(tutel_case.array("output").shape), tutel_case.array("output"),
                               rtol=1e-5, atol=1e-5)


def test_module_output_and_stats_match_tutel(tutel_case):
    layer = _load_layer(tutel_case)
    x = jnp.asarray(tutel_case.array("input"))
    y = layer(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(y), tutel_case.array("output"), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(layer.l_aux), float(tutel_case.array("l_aux")), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(layer.dispatch_count), tutel_case.array("dispatch_count"))
    assert int(layer.capacity) == tutel_case.meta["capacity"]
    k, S = tutel_case.config["k"], x.shape[0] * x.shape[1]
    np.testing.assert_allclose(float(layer.dropped_fraction), tutel_case.meta["dropped_assignments"] / (k * S),
                               rtol=1e-6)


def _assert_grad_close(actual, expected, name):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, name
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max(), err_msg=name)


def test_gradients_match_tutel(tutel_case):
    """loss = sum(y * upstream) + 0.01 * l_aux, gradients w.r.t. the input and every parameter, under jit."""
    layer = _load_layer(tutel_case)
    x = jnp.asarray(tutel_case.array("input"))
    upstream = jnp.asarray(tutel_case.array("upstream"))
    config = layer.config

    @jax.jit
    def grads(params, x):
        def loss(params, x):
            y, aux = moe_apply(params, x, config)
            return jnp.sum(y * upstream) + 0.01 * aux.l_aux
        return jax.grad(loss, argnums=(0, 1))(params, x)

    g_params, g_x = grads(layer.param_tree(), x)
    _assert_grad_close(g_x, tutel_case.array("grad_input"), "grad_input")
    flat = {"gates.0.wg.weight": g_params["gates"][0]["wg"]["weight"],
            **{f"experts.{k}": v for k, v in g_params["experts"].items()}}
    expected_names = sorted(p.stem for p in (tutel_case.dir / "grad_params").glob("*.npy"))
    assert sorted(flat) == expected_names
    for name in expected_names:
        _assert_grad_close(flat[name], np.load(tutel_case.dir / "grad_params" / f"{name}.npy"), name)


def test_nnx_grad_through_module_matches_tutel(tutel_case):
    """The same gradients through the stateful module under nnx.jit / nnx.grad, reading layer.l_aux."""
    layer = _load_layer(tutel_case)
    x = jnp.asarray(tutel_case.array("input"))
    upstream = jnp.asarray(tutel_case.array("upstream"))

    @nnx.jit
    def grads(layer, x):
        def loss(layer):
            return jnp.sum(layer(x) * upstream) + 0.01 * layer.l_aux
        return nnx.grad(loss)(layer)

    g = grads(layer, x)
    _assert_grad_close(g.params["gates"][0]["wg"]["weight"][...],
                       np.load(tutel_case.dir / "grad_params" / "gates.0.wg.weight.npy"), "gate")
    _assert_grad_close(g.params["experts"]["batched_fc1_w"][...],
                       np.load(tutel_case.dir / "grad_params" / "experts.batched_fc1_w.npy"), "fc1_w")
    np.testing.assert_allclose(float(layer.l_aux), float(tutel_case.array("l_aux")), rtol=0, atol=1e-6)
