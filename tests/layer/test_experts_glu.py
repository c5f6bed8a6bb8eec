"""SwiGLU, GPT-OSS clamped SwiGLU with biases, and shared experts against float64 NumPy written
from the HF formulas; the batched (capacity) and grouped (dropless) forms agree; option validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import reference_routers_np as ref
from tutel_jax import make_config
from tutel_jax.experts import make_experts, make_shared_experts

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
    assert {n: w.shape for n, w in params.items()} == {"gate_proj": (E, H, M), "up_proj": (E, H, M),
                                                       "down_proj": (E, M, H)}
    p = _f64(params)
    # HF per-expert weights [out, in], stacked: gate_proj.weight = gate_proj[e], etc.
    _check_batched_and_grouped(experts, params, lambda e, x: ref.swiglu(
        x, p["gate_proj"][e], p["up_proj"][e], p["down_proj"][e]))
    assert experts.hidden_axes(params) == {"gate_proj": 1, "up_proj": 1, "down_proj": 2}


@pytest.mark.parametrize("limit", [7.0, 0.5])
def test_gpt_oss_experts_match_hf_formula(limit):
    experts = make_experts({"type": "gpt_oss", "hidden_size_per_expert": H, "swiglu_limit": limit})
    params = experts.init(jax.random.key(1), M, E, jnp.float32)
    assert params["gate_up_proj"].shape == (E, 2 * H, M) and params["down_proj"].shape == (E, M, H)
    p = _f64(params)
    # the reference takes HF's stored [in, out]
    _check_batched_and_grouped(experts, params, lambda e, x: ref.gpt_oss_expert(
        x, p["gate_up_proj"][e].T, p["gate_up_proj_bias"][e], p["down_proj"][e].T, p["down_proj_bias"][e], 1.702,
        limit))
    if limit == 0.5:  # the clamps are active on a good share of the pre-activations
        h = _x(40, 2, 2.0) @ p["gate_up_proj"][0].T + p["gate_up_proj_bias"][0]
        assert (h[:, ::2] > limit).mean() > 0.1 and (np.abs(h[:, 1::2]) > limit).mean() > 0.1


@pytest.mark.parametrize("gated", [False, True])
def test_shared_experts_match_formula(gated):
    shared = make_shared_experts({"hidden_size": 7, "gate": gated})
    params = shared.init(jax.random.key(2), M, M, jnp.float32)
    x = _x(9, 3)
    p = {k: np.asarray(v, np.float64) for k, v in params.items() if k != "gate"}
    want = ref.swiglu(x.astype(np.float64), p["gate_proj"], p["up_proj"], p["down_proj"])  # [out, in]
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


# --- one expert contract over one grouped-linear primitive ---------------------------------------------------------

ALL_TYPES = [{"type": "ffn", "hidden_size_per_expert": H}, {"type": "llama_ffn", "hidden_size_per_expert": H},
             {"type": "swiglu", "hidden_size_per_expert": H}, {"type": "gpt_oss", "hidden_size_per_expert": H},
             {"type": "swiglu", "hidden_size_per_expert": 32, "weight_format": "nvfp4"},
             {"type": "gpt_oss", "hidden_size_per_expert": 32, "weight_format": "mxfp4"},
             {"type": "swiglu", "hidden_size_per_expert": 32, "weight_format": "fp8_block"},
             {"type": "gpt_oss", "hidden_size_per_expert": 32, "weight_format": "int8"},
             {"type": "swiglu", "hidden_size_per_expert": 32, "weight_format": "fp8_channel"}]


@pytest.mark.parametrize("spec", ALL_TYPES, ids=lambda s: s["type"] + "_" + str(s.get("weight_format")))
def test_every_expert_type_runs_batched_grouped_and_gathered_alike(spec):
    """The math written once (`apply`) gives the same rows through Batched, Grouped and Gathered, float and packed
    weights alike; the three methods and the contract's members are declared (no probing)."""
    from tutel_jax.experts import Experts

    experts = make_experts(spec)
    assert isinstance(experts, Experts) and experts.supports("grouped") and experts.supports("gathered")
    quant = spec.get("weight_format") is not None
    assert experts.supports("hidden_axes") is not quant and experts.output_dim is None
    assert experts.kernel_backend is None and experts.hidden_size_per_expert == spec["hidden_size_per_expert"]
    model_dim = 32 if quant else M
    params = experts.init(jax.random.key(3), model_dim, E, jnp.float32)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(E, 4, model_dim)).astype(np.float32))
    want = np.asarray(experts.batched(params, x)).reshape(E * 4, -1)
    rows = x.reshape(E * 4, model_dim)
    got_g = experts.grouped(params, rows, jnp.full((E,), 4, jnp.int32))
    got_r = experts.gathered(params, rows, jnp.repeat(jnp.arange(E), 4))
    np.testing.assert_allclose(np.asarray(got_g), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_r), want, rtol=1e-5, atol=1e-5)


def test_quantized_swiglu_is_swiglu_with_packed_weights():
    """`weight_format` makes SwiGLU / GPT-OSS experts hold packed weights: the same classes, no Quant* types,
    the same parameter tree (names and logical shapes) as float weights; the quantized result equals the float
    experts' on the dequantized weights."""
    from tutel_jax.quant import _weights as quant_weights
    from tutel_jax.experts import GptOssExperts, SwiGLUExperts

    q = make_experts({"type": "swiglu", "hidden_size_per_expert": 32, "weight_format": "nvfp4"})
    assert type(q) is SwiGLUExperts and q.weight_format == "nvfp4" and q.hidden_axes is None
    g = make_experts({"type": "gpt_oss", "hidden_size_per_expert": 32, "weight_format": "mxfp4"})
    assert type(g) is GptOssExperts and g.weight_format == "mxfp4"
    params = q.init(jax.random.key(5), 32, E, jnp.float32)
    assert all(quant_weights.is_quantized(params[n]) for n in ("gate_proj", "up_proj", "down_proj"))
    float_params = {n: quant_weights.dequantize(w) for n, w in params.items()}
    f = make_experts({"type": "swiglu", "hidden_size_per_expert": 32})
    template = jax.eval_shape(lambda: f.init(jax.random.key(0), 32, E, jnp.float32))
    assert {n: quant_weights.logical_shape(w) for n, w in params.items()} == {n: t.shape for n, t in template.items()}
    x = jnp.asarray(np.random.default_rng(6).normal(size=(E, 5, 32)).astype(np.float32))
    np.testing.assert_allclose(np.asarray(q.batched(params, x)), np.asarray(f.batched(float_params, x)),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="weight_format"):
        make_experts({"type": "swiglu", "hidden_size_per_expert": 32, "weight_format": "int4"})


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("in_out", [False, True])
def test_grouped_linear_primitive_reads_one_layout_against_float64(in_out, backend):
    """The primitive takes expert weights [E, out, in] (Tutel's [E, in, out] with in_out=True) in its three modes
    and both backends reachable on a CPU (XLA's ragged_dot_general; the Pallas kernel interpreted), value and
    gradient, against float64: row r of expert e is x[r] @ W_e.T."""
    from tutel_jax.experts import batched_linear, gathered_linear, grouped_linear

    rng = np.random.default_rng(7)
    n_out, n_in, sizes = 6, 5, np.array([3, 0, 4])
    w = rng.normal(size=(E, n_out, n_in)).astype(np.float32)  # [E, out, in]
    stored = jnp.asarray(w.transpose(0, 2, 1) if in_out else w)
    x = rng.normal(size=(int(sizes.sum()) + 2, n_in)).astype(np.float32)  # two rows past the groups
    rows = np.repeat(np.arange(E), sizes)
    want = np.zeros((x.shape[0], n_out))
    want[:len(rows)] = np.einsum("rk,rnk->rn", x[:len(rows)].astype(np.float64), w[rows].astype(np.float64))
    tol = dict(rtol=1e-5, atol=1e-5)
    grouped = lambda x, w: grouped_linear(x, w, jnp.asarray(sizes, jnp.int32), backend, in_out=in_out)
    np.testing.assert_allclose(np.asarray(grouped(jnp.asarray(x), stored)), want, **tol)
    got_r = gathered_linear(jnp.asarray(x[:len(rows)]), stored, jnp.asarray(rows), in_out=in_out)
    np.testing.assert_allclose(np.asarray(got_r), want[:len(rows)], **tol)
    buf = rng.normal(size=(E, 2, n_in)).astype(np.float32)
    want_b = np.einsum("eck,enk->ecn", buf.astype(np.float64), w.astype(np.float64))
    np.testing.assert_allclose(np.asarray(batched_linear(jnp.asarray(buf), stored, in_out=in_out)), want_b, **tol)
    # d/dW of sum(y * c) is c[rows].T @ x per expert, in the weight's own layout
    c = rng.normal(size=(x.shape[0], n_out)).astype(np.float32)
    d_w = jax.grad(lambda w: jnp.sum(grouped(jnp.asarray(x), w) * c))(stored)
    want_d = np.zeros(w.shape)
    for e in range(E):
        sel = rows == e
        want_d[e] = c[:len(rows)][sel].astype(np.float64).T @ x[:len(rows)][sel].astype(np.float64)
    np.testing.assert_allclose(np.asarray(d_w), want_d.transpose(0, 2, 1) if in_out else want_d, **tol)


def test_packed_weights_have_one_layout():
    from tutel_jax.experts import grouped_linear
    from tutel_jax.quant import quantize

    w = quantize(jnp.ones((E, 32, 32)), "mxfp4")
    with pytest.raises(ValueError, match=r"a packed expert weight is \[E, out, in\]"):
        grouped_linear(jnp.ones((3, 32)), w, jnp.array([1, 1, 1], jnp.int32), "xla", in_out=True)


def test_no_import_circle_and_no_quant_experts_module():
    """experts_quant is gone; experts_glu and the primitive import without a cycle."""
    import importlib.util
    import subprocess
    import sys

    assert importlib.util.find_spec("tutel_jax.experts_quant") is None
    code = ("import sys, tutel_jax.experts._grouped_linear, tutel_jax.experts._glu as g; "
            "assert not hasattr(g, 'QuantSwiGLUExperts') and not hasattr(g, 'QuantGptOssExperts')")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_minimal_custom_experts_are_adapted_at_make_config():
    """An object with only init + batched (the old protocol) is wrapped: the contract's members take their
    defaults, its own attributes and optional methods pass through, and the layer runs it."""
    import dataclasses

    from tutel_jax.experts._base import AdaptedExperts, Experts
    from tutel_jax.layer import init_params, moe_apply

    @dataclasses.dataclass(frozen=True)
    class Scale:
        num_local_experts: int = 2
        kernel_backend: str | None = None
        tag: str = "mine"

        def init(self, key, model_dim, num_experts, dtype):
            return {"w": jnp.arange(1, num_experts + 1, dtype=dtype)}

        def batched(self, params, x):
            return x * params["w"][:, None, None]

    config = make_config({"type": "top", "k": 1}, M, Scale())
    assert isinstance(config.experts, AdaptedExperts) and isinstance(config.experts, Experts)
    ex = config.experts
    assert ex.grouped is None and ex.gathered is None and ex.hidden_axes is None and ex.output_dim is None
    assert not ex.supports("grouped") and ex.num_local_experts == 2 and config.num_global_experts == 2
    assert ex.tag == "mine" and ex.type_name == "Scale" and ex.hidden_size_per_expert is None
    assert config.output_dim == M and hash(config.experts) == hash(make_config({"type": "top", "k": 1}, M,
                                                                               Scale()).experts)
    params = init_params(config, jax.random.key(0))
    x = jnp.asarray(_x(6, 7))
    y, _ = jax.jit(lambda p, x: moe_apply(p, x, config))(params, x)
    assert y.shape == (6, M)
    # kernel_backend is copied into a wrapped dataclass that has the field
    assert make_config({"type": "top", "k": 1}, M, Scale(), kernel_backend="xla").experts.inner.kernel_backend == "xla"

    class WithGrouped:  # optional methods of the wrapped object are found
        def init(self, key, model_dim, num_experts, dtype):
            return {"w": jnp.ones((num_experts,), dtype)}

        def batched(self, params, x):
            return x

        def grouped(self, params, x, group_sizes):
            return x

    ex = make_config({"type": "top", "k": 1}, M, WithGrouped()).experts
    assert ex.supports("grouped") and ex.grouped is not None and not ex.supports("gathered")
    with pytest.raises(ValueError, match=r"init\(\) and batched\(\)"):
        make_config({"type": "top", "k": 1}, M, object())


def test_registered_factory_returning_a_minimal_object_is_adapted():
    from tutel_jax.experts._base import EXPERT_TYPES, AdaptedExperts, register_experts

    class Identity:
        def init(self, key, model_dim, num_experts, dtype):
            return {}

        def batched(self, params, x):
            return x

    register_experts("identity_test", lambda: Identity())
    try:
        ex = make_config({"type": "top", "k": 1}, M, {"type": "identity_test", "count_per_node": 2}).experts
        assert isinstance(ex, AdaptedExperts) and ex.grouped is None
    finally:
        EXPERT_TYPES.pop("identity_test")
