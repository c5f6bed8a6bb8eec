"""The NNX `MoE` module and Tutel-compatible constructor: shapes, dtypes, per-call switches, statistics,
training mode, custom gate/expert protocols, bad input, NaN, and the Linen adapter inside a Linen model."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from support import reference_np as ref
from tutel_jax import MoE, make_config, moe, moe_apply
from tutel_jax.nn import MoELinen

M = 16
GATE = {"type": "top", "k": 2}
EXPERTS = {"type": "ffn", "count_per_node": 4, "hidden_size_per_expert": 32}


def _layer(**kw):
    args = dict(gate_type=GATE, model_dim=M, experts=EXPERTS, rngs=nnx.Rngs(0))
    args.update(kw)
    return moe.moe_layer(**args)


@pytest.mark.parametrize("shape", [(M,), (5, M), (2, 3, M), (2, 2, 3, M)])
def test_any_leading_shape(shape):
    layer = _layer()
    x = jax.random.normal(jax.random.key(0), shape)
    y = layer(x)
    assert y.shape == shape and y.dtype == x.dtype
    flat = layer(x.reshape(-1, M))
    np.testing.assert_allclose(np.asarray(y).reshape(-1, M), np.asarray(flat), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_output_keeps_input_dtype(dtype):
    layer = _layer(dtype=dtype)
    x = jax.random.normal(jax.random.key(0), (6, M)).astype(dtype)
    y = layer(x)
    assert y.dtype == dtype and np.isfinite(np.asarray(y, np.float32)).all()
    y32 = layer(x.astype(jnp.float32))  # input dtype preserved even if it differs from the layer's
    assert y32.dtype == jnp.float32


def test_per_call_switches_and_stats():
    layer = _layer()
    x = jax.random.normal(jax.random.key(1), (64, M))
    layer(x)
    assert int(layer.dispatch_count.sum()) == 128 and int(layer.capacity) == 2 * 16
    layer(x, top_k=1, capacity_factor=0.25)
    assert int(layer.dispatch_count.sum()) == 64 and int(layer.capacity) == 4
    dropped = float(layer.dropped_fraction)
    assert 0 < dropped < 1
    assert dropped == pytest.approx(float(np.maximum(np.asarray(layer.dispatch_count) - 4, 0).sum()) / 64)
    layer(x, capacity_factor=0.0)
    assert float(layer.dropped_fraction) == 0.0 and int(layer.capacity) == int(layer.dispatch_count.max())
    layer(x, top_k=9)  # clipped to E like Tutel
    assert int(layer.dispatch_count.sum()) == 4 * 64
    with pytest.raises(ValueError, match="top_k"):
        layer(x, top_k=0)
    with pytest.raises(ValueError, match="capacity_factor"):
        layer(x, capacity_factor="big")


def test_module_matches_functional_core_and_numpy_reference():
    layer = _layer(seeds=(1, 2, 3))
    x = np.random.default_rng(0).normal(size=(3, 10, M)).astype(np.float32)
    y = layer(jnp.asarray(x))
    y_fn, aux = moe_apply(layer.param_tree(), jnp.asarray(x), layer.config)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_fn))
    p = layer.param_tree()
    y_ref, l_ref, _ = ref.layer(x.reshape(-1, M), {"wg": np.asarray(p["gates"][0]["wg"]["weight"]),
                                                  **{k: np.asarray(v) for k, v in p["experts"].items()}}, 2, 1.0)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, M), y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(layer.l_aux), l_ref, rtol=1e-5)


def test_seeds_are_reproducible():
    a, b = _layer(seeds=(1, 2, 3)), _layer(seeds=(1, 2, 3))
    for u, v in zip(jax.tree.leaves(a.param_tree()), jax.tree.leaves(b.param_tree())):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    c = _layer(seeds=(1, 5, 3))
    np.testing.assert_array_equal(np.asarray(a.param_tree()["gates"][0]["wg"]["weight"]),
                                  np.asarray(c.param_tree()["gates"][0]["wg"]["weight"]))
    assert not np.array_equal(np.asarray(a.param_tree()["experts"]["batched_fc1_w"]),
                              np.asarray(c.param_tree()["experts"]["batched_fc1_w"]))


def test_training_noise_and_eval_mode():
    layer = _layer(gate_type={"type": "top", "k": 1, "gate_noise": 10.0})
    x = jax.random.normal(jax.random.key(2), (128, M))
    noisy_a, noisy_b = layer(x), layer(x)
    assert not np.array_equal(np.asarray(noisy_a), np.asarray(noisy_b))  # fresh noise on every training call
    layer.eval()
    y1, y2 = layer(x), layer(x)
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
    clean = moe_apply(layer.param_tree(), x, layer.config, deterministic=True)[0]
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(clean))
    layer.train()
    assert not np.array_equal(np.asarray(layer(x)), np.asarray(clean))


def test_training_step_with_optimizer_reduces_loss():
    import optax
    layer = _layer()
    x = jax.random.normal(jax.random.key(3), (32, M))
    target = jax.random.normal(jax.random.key(4), (32, M))
    opt = nnx.Optimizer(layer, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(layer, opt):
        def loss_fn(layer):
            return jnp.mean((layer(x) - target) ** 2) + 0.01 * layer.l_aux
        loss, grads = nnx.value_and_grad(loss_fn)(layer)
        opt.update(layer, grads)
        return loss

    losses = [float(step(layer, opt)) for _ in range(15)]
    assert losses[-1] < 0.8 * losses[0]


def test_llama_ffn_experts_match_reference():
    layer = _layer(experts={"type": "llama_ffn", "count_per_node": 4, "hidden_size_per_expert": 8})
    p = layer.param_tree()["experts"]
    assert p["W_fc1"].shape == (4, M, 8) and p["W_fc3"].shape == (4, 8, M)
    buf = np.random.default_rng(0).normal(size=(4, 5, M))
    got = layer.config.experts.batched(p, jnp.asarray(buf, jnp.float32))
    w1, w2, w3 = (np.asarray(p[n], np.float64) for n in ("W_fc1", "W_fc2", "W_fc3"))
    g = np.einsum("ecm,emh->ech", buf, w1)
    want = np.einsum("ech,ehm->ecm", g / (1 + np.exp(-g)) * np.einsum("ecm,emh->ech", buf, w2), w3)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-8)
    x = jax.random.normal(jax.random.key(0), (20, M))
    dropless = layer(x, capacity_factor=0.0)
    padded = layer(x, capacity_factor=10.0)
    np.testing.assert_allclose(np.asarray(dropless), np.asarray(padded), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("act", ["gelu", jax.nn.tanh])
def test_ffn_activation_and_no_bias(act):
    layer = _layer(experts=dict(EXPERTS, activation_fn=act, has_fc1_bias=False, has_fc2_bias=False))
    p = layer.param_tree()["experts"]
    assert set(p) == {"batched_fc1_w", "batched_fc2_w"}
    buf = jax.random.normal(jax.random.key(0), (4, 3, M))
    fn = jax.nn.gelu if act == "gelu" else act
    want = jnp.einsum("ech,ehm->ecm", fn(jnp.einsum("ecm,ehm->ech", buf, p["batched_fc1_w"])), p["batched_fc2_w"])
    np.testing.assert_allclose(np.asarray(layer.config.experts.batched(p, buf)), np.asarray(want), rtol=1e-6)


@dataclasses.dataclass(frozen=True)
class FirstFeatureGate:
    """A custom gate: logits = x[:, :E] * scale (the protocol: k, capacity_factor, gate_noise, init, logits)."""
    k: int = 1
    capacity_factor: float = 1.0
    gate_noise: float = 0.0

    def init(self, key, model_dim, num_experts, dtype):
        return {"scale": jnp.ones((), dtype)}

    def logits(self, params, x):
        return x[:, :4] * params["scale"]


@dataclasses.dataclass(frozen=True)
class ScaleExperts:
    """A custom expert: each expert e multiplies its tokens by w[e] (batched only: no dropless under jit)."""

    def init(self, key, model_dim, num_experts, dtype):
        return {"w": jnp.arange(1, num_experts + 1, dtype=dtype)}

    def batched(self, params, x):
        return x * params["w"][:, None, None]


def test_custom_gate_and_custom_experts():
    layer = MoE(gate_type=FirstFeatureGate(), model_dim=M,
                experts={"type": "ffn", "count_per_node": 4, "hidden_size_per_expert": 4}, rngs=nnx.Rngs(0))
    x = jnp.eye(4, M) * 5.0  # token i routes to expert i
    layer(x)
    np.testing.assert_array_equal(np.asarray(layer.dispatch_count), [1, 1, 1, 1])

    custom = MoE(gate_type=FirstFeatureGate(), model_dim=M, experts=ScaleExperts(), rngs=nnx.Rngs(0))
    assert custom.num_global_experts == 1  # one local expert unless the object says otherwise

    @dataclasses.dataclass(frozen=True)
    class FourScaleExperts(ScaleExperts):
        num_local_experts: int = 4

    custom = MoE(gate_type=FirstFeatureGate(), model_dim=M, experts=FourScaleExperts(), rngs=nnx.Rngs(0))
    y = custom(x)
    prob = jnp.diag(jax.nn.softmax(x[:, :4], axis=1))  # top-1 combine weight of token i at expert i
    np.testing.assert_allclose(np.asarray(y), np.asarray(x * (jnp.arange(1, 5) * prob)[:, None]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(custom(x, capacity_factor=0.0)), np.asarray(y), rtol=1e-6)  # eager
    with pytest.raises(ValueError, match="grouped"):
        jax.jit(lambda p, x: moe_apply(p, x, custom.config, capacity_factor=0.0))(custom.param_tree(), x)


@pytest.mark.parametrize("kwargs,match", [
    (dict(gate_type={"type": "nope"}), r"gate_type\[0\]\['type'\]"),
    (dict(gate_type={"type": "top", "k": 0}), r"gate_type\[0\]\['k'\]"),
    (dict(gate_type={"type": "top", "k": 1.5}), r"gate_type\[0\]\['k'\]"),
    (dict(gate_type={"type": "top", "k": 1, "temperature": 2}), "unknown option"),
    (dict(gate_type="Top2Gatex"), "Top<k>Gate"),
    (dict(gate_type=[]), "gate_type must not be empty"),
    (dict(experts={"type": "mlp", "count_per_node": 2, "hidden_size_per_expert": 4}), r"experts\['type'\]"),
    (dict(experts={"type": "ffn", "count_per_node": 1.5, "hidden_size_per_expert": 4}), "count_per_node"),
    (dict(experts={"type": "ffn", "count_per_node": 0, "hidden_size_per_expert": 4}), "count_per_node"),
    (dict(experts={"type": "ffn", "count_per_node": -2, "hidden_size_per_expert": 4}), "divide"),
    (dict(experts={"type": "ffn", "count_per_node": 2, "hidden_size_per_expert": 0}), "hidden_size_per_expert"),
    (dict(experts={"type": "ffn", "count_per_node": 2, "hidden_size_per_expert": 4, "bogus": 1}), "bad options"),
    (dict(experts={"type": "ffn", "count_per_node": 2, "hidden_size_per_expert": 4, "activation_fn": "nope"}),
     "activation_fn"),
    (dict(experts=None), "experts must be given"),
    (dict(model_dim=0), "model_dim"),
    (dict(model_dim=16.0), "model_dim"),
    (dict(not_an_arg=1), "unknown argument"),
    (dict(a2a_ffn_overlap_degree=0), "a2a_ffn_overlap_degree"),
    (dict(parallel_type="pipeline"), "parallel_type"),
    (dict(dtype="float99"), "dtype"),
    (dict(seeds=(1,)), "seeds"),
])
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _layer(**kwargs)


def test_bad_call_arguments():
    layer = _layer()
    with pytest.raises(ValueError, match="model_dim=16"):
        layer(jnp.zeros((4, M + 1)))
    with pytest.raises(ValueError, match="gate_index"):
        layer(jnp.zeros((4, M)), gate_index=1)


def test_nan_input_propagates_without_crash():
    layer = _layer()
    x = jax.random.normal(jax.random.key(0), (16, M)).at[3].set(jnp.nan)
    y = layer(x)
    assert y.shape == x.shape
    assert np.isnan(np.asarray(y)[3]).all()
    assert np.isfinite(np.delete(np.asarray(y), 3, axis=0)).all()  # one slot per token: no spreading
    assert np.isnan(float(layer.l_aux))
    assert np.isfinite(np.asarray(layer.dispatch_count)).all()


def test_get_parameter_iterator_and_global_expert_count():
    layer = _layer()
    names = [n for n, _ in layer.get_parameter_iterator("local_experts")]
    assert names == sorted(["experts.batched_fc1_bias", "experts.batched_fc1_w", "experts.batched_fc2_bias",
                            "experts.batched_fc2_w"])
    assert [n for n, _ in layer.get_parameter_iterator("gate")] == ["gates.0.wg.weight"]
    with pytest.raises(ValueError, match="param_type"):
        list(layer.get_parameter_iterator("all"))
    assert moe.moe_layer.global_expert_count(3) == 3
    seen = []
    _layer(scan_expert_func=lambda name, p: seen.append(name))
    assert "experts.batched_fc1_w" in seen


def test_result_func_applied():
    layer = _layer(result_func=lambda y: y * 0 + 1)
    assert np.all(np.asarray(layer(jnp.ones((3, M)))) == 1)


class TinyLinenModel(nn.Module):
    """Embedding -> MoE -> head, the way a user embeds the layer in a Linen model."""

    @nn.compact
    def __call__(self, x, deterministic=True):
        h = nn.Dense(M, name="inp")(x)
        h = h + MoELinen(gate_type={"type": "top", "k": 2}, model_dim=M, experts=EXPERTS, name="moe")(
            h, deterministic=deterministic)
        return nn.Dense(3, name="head")(h)


def test_linen_adapter_inside_a_linen_model():
    model = TinyLinenModel()
    x = jax.random.normal(jax.random.key(0), (2, 6, 8))
    variables = model.init(jax.random.key(1), x)
    params = variables["params"]
    assert set(params) == {"inp", "moe", "head"}
    out, state = model.apply(variables, x, mutable=["intermediates"])
    l_aux = state["intermediates"]["moe"]["l_aux"][0]
    # the same computation by hand through the functional core
    config = make_config({"type": "top", "k": 2}, M, EXPERTS)
    h = x @ params["inp"]["kernel"] + params["inp"]["bias"]
    y, aux = moe_apply(params["moe"]["moe"], h, config)
    want = (h + y) @ params["head"]["kernel"] + params["head"]["bias"]
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(l_aux), float(aux.l_aux), rtol=1e-6)

    def loss(params):
        out, state = model.apply({"params": params}, x, mutable=["intermediates"])
        return jnp.sum(out ** 2) + 0.01 * state["intermediates"]["moe"]["l_aux"][0]

    grads = jax.jit(jax.grad(loss))(params)
    g_gate = grads["moe"]["moe"]["gates"][0]["wg"]["weight"]
    assert np.abs(np.asarray(g_gate)).max() > 0 and np.abs(np.asarray(grads["inp"]["kernel"])).max() > 0


def test_linen_gate_noise_uses_rng_stream():
    module = MoELinen(gate_type={"type": "top", "k": 1, "gate_noise": 10.0}, model_dim=M, experts=EXPERTS)
    x = jax.random.normal(jax.random.key(0), (64, M))
    variables = module.init(jax.random.key(1), x)
    a = module.apply(variables, x, deterministic=False, rngs={"gate_noise": jax.random.key(2)})
    b = module.apply(variables, x, deterministic=False, rngs={"gate_noise": jax.random.key(2)})
    c = module.apply(variables, x, deterministic=True)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))
