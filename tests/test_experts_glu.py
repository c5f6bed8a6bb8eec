"""SwiGLU (fused gate/up), GPT-OSS clamped SwiGLU with biases, and shared experts against float64 NumPy written
from the HF formulas; the batched (capacity) and grouped (dropless) forms agree; option validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference_routers_np as ref
from tutel_jax import make_config
from tutel_jax.experts import make_experts
from tutel_jax.shared_experts import make_shared_experts

M, H, E = 12, 10, 3


def _x(n, seed=0, scale=1.0):
    return (np.random.default_rng(seed).normal(size=(n, M)) * scale).astype(np.float32)


def _f64(tree):
    return {k: np.asarray(v, np.float64) for k, v in tree.items()}


def _check_batched_and_grouped(experts, params, per_expert):
    x = _x(E * 5, 1, 2.0)
    sizes = np.array([4, 0, 11])  # an empty expert, and rows that are not E * C
    rows = x[:sizes.sum()]
    want = np.concatenate([per_expert(e, rows[sizes[:e].sum():sizes[:e + 1].sum()].astype(np.float64))
                           for e in range(E)])
    got = experts.grouped(params, jnp.asarray(rows), jnp.asarray(sizes, jnp.int32))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    buf = x.reshape(E, 5, M)
    want_b = np.stack([per_expert(e, buf[e].astype(np.float64)) for e in range(E)])
    np.testing.assert_allclose(np.asarray(experts.batched(params, jnp.asarray(buf))), want_b, rtol=1e-5, atol=1e-5)


def test_swiglu_matches_hf_formula():
    experts = make_experts({"type": "swiglu", "hidden_size_per_expert": H})
    params = experts.init(jax.random.key(0), M, E, jnp.float32)
    assert params["gate_up_proj"].shape == (E, M, 2, H) and params["down_proj"].shape == (E, H, M)
    p = _f64(params)
    # HF per-expert weights: gate_proj.weight = gate_up_proj[e, :, 0].T [I, M], etc.
    _check_batched_and_grouped(experts, params, lambda e, x: ref.swiglu(
        x, p["gate_up_proj"][e, :, 0].T, p["gate_up_proj"][e, :, 1].T, p["down_proj"][e].T))
    assert experts.hidden_axes(params) == {"gate_up_proj": 3, "down_proj": 1}


@pytest.mark.parametrize("limit", [7.0, 0.5])
def test_gpt_oss_experts_match_hf_formula(limit):
    experts = make_experts({"type": "gpt_oss", "hidden_size_per_expert": H, "swiglu_limit": limit})
    params = experts.init(jax.random.key(1), M, E, jnp.float32)
    p = _f64(params)
    _check_batched_and_grouped(experts, params, lambda e, x: ref.gpt_oss_expert(
        x, p["gate_up_proj"][e], p["gate_up_proj_bias"][e], p["down_proj"][e], p["down_proj_bias"][e], 1.702, limit))
    if limit == 0.5:  # the clamps are active on a good share of the pre-activations
        h = _x(40, 2, 2.0) @ p["gate_up_proj"][0] + p["gate_up_proj_bias"][0]
        assert (h[:, ::2] > limit).mean() > 0.1 and (np.abs(h[:, 1::2]) > limit).mean() > 0.1


@pytest.mark.parametrize("gated", [False, True])
def test_shared_experts_match_formula(gated):
    shared = make_shared_experts({"hidden_size": 7, "gate": gated})
    params = shared.init(jax.random.key(2), M, M, jnp.float32)
    x = _x(9, 3)
    p = {k: np.asarray(v, np.float64) for k, v in params.items() if k != "gate"}
    want = ref.swiglu(x.astype(np.float64), p["gate_proj"].T, p["up_proj"].T, p["down_proj"].T)
    if gated:
        want = want * ref.sigmoid(x.astype(np.float64) @ np.asarray(params["gate"]["weight"], np.float64).T)
    np.testing.assert_allclose(np.asarray(shared.apply(params, jnp.asarray(x))), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("experts,match", [
    ({"type": "gpt_oss", "count_per_node": 2, "hidden_size_per_expert": 4, "swiglu_limit": -1}, "swiglu_limit"),
    ({"type": "swiglu", "count_per_node": 2, "hidden_size_per_expert": 4, "shared": {"hidden": 3}}, "unknown option"),
    ({"type": "swiglu", "count_per_node": 2, "hidden_size_per_expert": 4, "shared": {"hidden_size": 0}},
     "hidden_size"),
    ({"type": "swiglu", "count_per_node": 2, "hidden_size_per_expert": 4, "shared": 5}, r"experts\['shared'\]"),
])
def test_bad_expert_options(experts, match):
    with pytest.raises(ValueError, match=match):
        make_config({"type": "mixtral"}, M, experts)
    with pytest.raises(ValueError, match="dropless_impl"):
        make_config({"type": "mixtral"}, M, {"type": "swiglu", "count_per_node": 2, "hidden_size_per_expert": 4},
                    dropless_impl="fast")
