"""`kernel_backend` on the layer: the Pallas dispatch/combine and grouped-matmul kernels (run by Pallas' CPU
interpreter here) give the same outputs and gradients as the plain-XLA layer, on the capacity and dropless paths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tutel_jax import init_params, make_config, moe_apply

M = 16


@pytest.mark.parametrize("cf,expert_type", [(1.0, "ffn"), (0.0, "ffn"), (0.5, "llama_ffn")])
def test_interpret_kernels_match_xla_layer(cf, expert_type):
    kwargs = dict(gate_type={"type": "top", "k": 2, "capacity_factor": cf}, model_dim=M,
                  experts={"type": expert_type, "count_per_node": 4, "hidden_size_per_expert": 8})
    plain = make_config(**kwargs)
    kernels = make_config(**kwargs, kernel_backend="interpret")
    assert kernels.kernel_backend == "interpret" and kernels.experts.kernel_backend == "interpret"
    params = init_params(plain, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 12, M))
    up = jax.random.normal(jax.random.key(2), x.shape)

    def loss(config):
        def fn(p, x):
            y, aux = moe_apply(p, x, config)
            return jnp.sum(y * up) + 0.1 * aux.l_aux, y
        return jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))

    (l0, y0), g0 = loss(plain)(params, x)
    (l1, y1), g1 = loss(kernels)(params, x)
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-5 * max(np.abs(b).max(), 1e-30))


def test_bad_kernel_backend():
    with pytest.raises(ValueError, match="kernel_backend"):
        make_config({"type": "top", "k": 2}, M, {"type": "ffn", "count_per_node": 2, "hidden_size_per_expert": 4},
                    kernel_backend="cuda")


@pytest.mark.parametrize("k,bpr", [(1, False), (2, True), (3, False)])
def test_fused_gating_kernel_gives_tutel_plan(k, bpr):
    from tutel_jax import route
    kwargs = dict(gate_type={"type": "top", "k": k, "capacity_factor": 0.75}, model_dim=M,
                  experts={"type": "ffn", "count_per_node": 6, "hidden_size_per_expert": 8},
                  batch_prioritized_routing=bpr)
    plain, kernels = make_config(**kwargs), make_config(**kwargs, kernel_backend="interpret")
    params = init_params(plain, jax.random.key(3))
    x = jax.random.normal(jax.random.key(4), (40, M))
    p0, l0 = route(params["gates"][0], x, plain)
    p1, l1 = route(params["gates"][0], x, kernels)
    for name in ("expert_ids", "locations", "dispatch_count", "capacity"):
        np.testing.assert_array_equal(np.asarray(getattr(p1, name)), np.asarray(getattr(p0, name)), err_msg=name)
    assert p1.buffer_capacity == p0.buffer_capacity
    np.testing.assert_allclose(np.asarray(p1.gates), np.asarray(p0.gates), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)


def test_tutel_oracle_with_kernels():
    from support.tutel_cases import TutelCase
    from tutel_jax import moe
    case = TutelCase("top2_cf1")
    layer = moe.moe_layer(**case.layer_kwargs(), seeds=(1, 2, 3), kernel_backend="interpret")
    layer.load_state_dict(case.dir / "state_dict.pt")
    y = layer(jnp.asarray(case.array("input")))
    np.testing.assert_allclose(np.asarray(y), case.array("output"), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(layer.dispatch_count), case.array("dispatch_count"))
    assert int(layer.capacity) == case.meta["capacity"]
