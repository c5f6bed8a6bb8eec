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
