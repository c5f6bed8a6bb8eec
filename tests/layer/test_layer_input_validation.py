"""Input hardening of the MoE layer: batches without tokens, the type of `capacity_factor` (at construction and
per call) and non-floating inputs, through `moe_apply`, the NNX module, the Linen adapter and the parallel paths.
Shapes, zeros and error types are checked exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from tutel_jax.core import _losses as losses
from tutel_jax import make_config, moe, moe_apply
from tutel_jax.experts import IMPLS
from tutel_jax.layer import init_params
from tutel_jax.nn import MoELinen
from tutel_jax.native import _build as build
from tutel_jax.parallel import ExpertParallel, moe_apply_expert_sliced, moe_apply_parallel
from tutel_jax.routing import GATE_TYPES

M, E, H = 8, 4, 16
FFN = {"type": "ffn", "count_per_node": E, "hidden_size_per_expert": H}
SWIGLU = {"type": "swiglu", "count_per_node": E, "hidden_size_per_expert": H}
EMPTY_SHAPES = [(0, M), (2, 0, M)]
CAPACITY_FACTORS = [1.0, 0.0, -1.0]
# 'native' compiles a C++ kernel on first use (tests/native/test_native_moe.py): it needs a compiler
NATIVE = pytest.param("native", marks=pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler"))
DROPLESS_IMPLS = [NATIVE if impl == "native" else impl for impl in IMPLS]


def _gate(kind: str, **kw) -> dict:
    """A gate dict of type `kind` for E = 4 experts (k = 2; expert choice ignores k)."""
    return {"type": kind, "k": 2, **kw}


def _apply(config, x, **kw):
    params = init_params(config, jax.random.key(0))
    return jax.jit(lambda p, x: moe_apply(p, x, config, **kw))(params, x)


def _assert_empty(y, aux, shape, dtype=jnp.float32, out_dim=M):
    assert y.shape == shape[:-1] + (out_dim,) and y.dtype == dtype
    assert float(aux.l_aux) == 0.0 and aux.l_aux.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(aux.dispatch_count), np.zeros((E,), np.int32))
    assert aux.dispatch_count.dtype == jnp.int32
    assert int(aux.capacity) == 0 and float(aux.dropped_fraction) == 0.0
    for name, value in aux.losses.items():
        assert float(value) == 0.0, name


# -- 1. batches without tokens ------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", EMPTY_SHAPES)
@pytest.mark.parametrize("cf", CAPACITY_FACTORS)
@pytest.mark.parametrize("kind", sorted(GATE_TYPES))
def test_empty_batch_every_gate_and_capacity_factor(kind, cf, shape):
    if kind == "expert_choice" and cf <= 0:
        pytest.skip("expert choice has a fixed capacity: cf <= 0 is an error for any batch (tested below)")
    config = make_config(_gate(kind, capacity_factor=cf), M, FFN)
    y, aux = _apply(config, jnp.zeros(shape, jnp.float32))
    _assert_empty(y, aux, shape)
    _, full = _apply(config, jnp.ones((4, M)))  # the same losses as for a batch with tokens
    assert set(aux.losses) == set(full.losses) and ((kind in ("top", "cosine_top")) == (not aux.losses))


@pytest.mark.parametrize("impl", DROPLESS_IMPLS)
@pytest.mark.parametrize("kind", ["top", "mixtral", "deepseek_v3"])
def test_empty_batch_every_dropless_impl(kind, impl):
    config = make_config(_gate(kind, capacity_factor=0.0), M, SWIGLU, dropless_impl=impl)
    for shape in EMPTY_SHAPES:
        y, aux = _apply(config, jnp.zeros(shape, jnp.bfloat16))
        _assert_empty(y, aux, shape, jnp.bfloat16)


def test_empty_batch_through_the_module_eagerly_and_in_training_mode():
    layer = moe.moe_layer(gate_type=_gate("top", gate_noise=1.0), model_dim=M, experts=FFN, rngs=nnx.Rngs(0))
    for shape in EMPTY_SHAPES:
        y = layer(jnp.zeros(shape))  # training mode: gate noise on
        assert y.shape == shape and y.dtype == jnp.float32
        assert float(layer.l_aux) == 0.0 and int(layer.dispatch_count.sum()) == 0
        assert int(layer.capacity) == 0 and float(layer.dropped_fraction) == 0.0
        y = layer(jnp.zeros(shape), top_k=1, capacity_factor=0.0)
        assert y.shape == shape


def test_empty_batch_keeps_output_dim_and_result_func():
    experts = {**FFN, "output_dim": 3, "shared": {"hidden_size": 4}}
    config = make_config(_gate("mixtral"), M, experts, result_func=lambda y: y * 2)
    y, aux = _apply(config, jnp.zeros((2, 0, M)))
    _assert_empty(y, aux, (2, 0, M), out_dim=3)


def test_empty_batch_still_validates_per_call_arguments():
    config = make_config(_gate("top"), M, FFN)
    params = init_params(config, jax.random.key(0))
    x = jnp.zeros((0, M))
    with pytest.raises(ValueError, match="top_k"):
        moe_apply(params, x, config, top_k=0)
    with pytest.raises(ValueError, match="capacity_factor"):
        moe_apply(params, x, config, capacity_factor="x")
    with pytest.raises(ValueError, match="gate_index"):
        moe_apply(params, x, config, gate_index=1)
    ec = make_config(_gate("expert_choice"), M, FFN)
    for cf in (0.0, -1.0):  # the same error as for a batch with tokens
        for batch in (jnp.zeros((0, M)), jnp.ones((4, M))):
            with pytest.raises(ValueError, match="capacity_factor must be > 0"):
                moe_apply(init_params(ec, jax.random.key(0)), batch, ec, capacity_factor=cf)


@pytest.mark.parametrize("kind,cf", [("top", 1.0), ("top", 0.0), ("mixtral", -1.0), ("deepseek_v3", 0.0)])
def test_empty_batch_gradients_are_zero(kind, cf):
    config = make_config(_gate(kind, capacity_factor=cf), M, SWIGLU)
    params = init_params(config, jax.random.key(0))

    def loss(p, x):
        y, aux = moe_apply(p, x, config)
        return jnp.sum(y) + aux.l_aux + sum(aux.losses.values())

    g_params, g_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, jnp.zeros((2, 0, M)))
    assert g_x.shape == (2, 0, M)
    for leaf, p in zip(jax.tree.leaves(g_params), jax.tree.leaves(params)):
        assert leaf.shape == p.shape
        np.testing.assert_array_equal(np.asarray(leaf), np.zeros(p.shape, np.asarray(leaf).dtype))


def test_empty_batch_expert_parallel_and_expert_sliced():
    devices = np.array(jax.devices()[:8])
    placement = ExpertParallel(Mesh(devices, ("expert",)))
    config = make_config(_gate("top", capacity_factor=0.0), M, {**FFN, "count_per_node": 1}, world_size=8)
    params = init_params(config, jax.random.key(0))
    for shape in [(0, 3, M), (8, 0, M)]:
        y, aux = moe_apply_parallel(params, jnp.zeros(shape), config, placement)
        assert y.shape == shape and float(aux.l_aux) == 0.0 and int(aux.dispatch_count.sum()) == 0
        assert aux.dispatch_count.shape == (8,) and float(aux.dropped_fraction) == 0.0
    sliced = make_config(_gate("mixtral", capacity_factor=0.0), M, SWIGLU)
    y, aux = moe_apply_expert_sliced(init_params(sliced, jax.random.key(0)), jnp.zeros((0, M)), sliced,
                                     Mesh(devices[:4], ("expert",)))
    _assert_empty(y, aux, (0, M))


def test_losses_of_no_tokens_are_zero():
    """The losses guard their own denominators: every mean over zero tokens is 0, never 0 / 0."""
    probs, ids = jnp.zeros((0, E)), jnp.zeros((2, 0), jnp.int32)
    values = {
        "gshard": losses.gshard_loss(probs, ids),
        "gshard_valid": losses.gshard_loss(probs, ids, jnp.zeros((0,), bool)),
        "switch": losses.switch_load_loss(probs, ids),
        "z_loss": losses.router_z_loss(probs),
        "seq_aux": losses.sequence_aux_loss(probs, ids, 1),
        "importance": losses.load_importance_loss(probs, jnp.zeros((0, 2)), E, 1.0),
    }
    for name, value in values.items():
        assert value.shape == () and float(value) == 0.0, name


# -- 2. capacity_factor must be a number --------------------------------------------------------------------

BAD_CAPACITY_FACTORS = ["x", "1.5", True, False, None, [1.0], float("nan"), float("inf")]


@pytest.mark.parametrize("cf", BAD_CAPACITY_FACTORS, ids=repr)
@pytest.mark.parametrize("kind", ["top", "cosine_top", "mixtral", "expert_choice"])
def test_bad_capacity_factor_in_gate_dict_fails_at_construction(kind, cf):
    with pytest.raises(ValueError, match=r"gate_type\[0\]\['capacity_factor'\] must be a .*number.*got"):
        make_config(_gate(kind, capacity_factor=cf), M, FFN)
    with pytest.raises(ValueError, match=r"capacity_factor.*number"):
        moe.moe_layer(gate_type=[_gate("top"), _gate(kind, capacity_factor=cf)], model_dim=M, experts=FFN,
                      rngs=nnx.Rngs(0))


def test_good_capacity_factors_are_accepted():
    for cf in (1, 1.5, -2, 0, np.float32(1.25), np.int64(2)):
        config = make_config(_gate("top", capacity_factor=cf), M, FFN)
        y, _ = _apply(config, jnp.ones((4, M)))
        assert y.shape == (4, M)


def test_custom_gate_object_with_bad_capacity_factor_fails_at_construction():
    from tutel_jax.routing import TopGate
    with pytest.raises(ValueError, match=r"gate_type\[0\]\['capacity_factor'\]"):
        make_config(TopGate(k=2, capacity_factor="x"), M, FFN)


@pytest.mark.parametrize("cf", [c for c in BAD_CAPACITY_FACTORS if c is not None], ids=repr)  # None: the default
def test_bad_per_call_capacity_factor_is_a_clear_error(cf):
    layer = moe.moe_layer(gate_type=_gate("top"), model_dim=M, experts=FFN, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"capacity_factor must be a .*number.*got"):
        layer(jnp.ones((4, M)), capacity_factor=cf)


# -- 3. the input must be floating-point --------------------------------------------------------------------

BAD_DTYPES = [jnp.int32, jnp.int8, jnp.uint8, jnp.bool_]
DTYPE_ERROR = r"x must have a floating dtype.*got (int32|int8|uint8|bool)"


@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_integer_input_is_refused(dtype):
    x = jnp.ones((4, M), dtype)
    config = make_config(_gate("top"), M, FFN)
    with pytest.raises(TypeError, match=DTYPE_ERROR):
        moe_apply(init_params(config, jax.random.key(0)), x, config)
    with pytest.raises(TypeError, match=DTYPE_ERROR):
        moe_apply(init_params(config, jax.random.key(0)), np.ones((0, M), jnp.dtype(dtype)), config)
    layer = moe.moe_layer(gate_type=_gate("mixtral"), model_dim=M, experts=FFN, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=DTYPE_ERROR):
        layer(x)
    with pytest.raises(TypeError, match=DTYPE_ERROR):
        MoELinen(gate_type=_gate("top"), model_dim=M, experts=FFN).init(jax.random.key(0), x)


def test_integer_input_is_refused_by_the_parallel_paths():
    devices = np.array(jax.devices()[:8])
    x = jnp.ones((8, 2, M), jnp.int32)
    config = make_config(_gate("top"), M, {**FFN, "count_per_node": 1}, world_size=8)
    with pytest.raises(TypeError, match=DTYPE_ERROR):
        moe_apply_parallel(init_params(config, jax.random.key(0)), x, config,
                           ExpertParallel(Mesh(devices, ("expert",))))
    sliced = make_config(_gate("top"), M, FFN)
    with pytest.raises(TypeError, match=DTYPE_ERROR):
        moe_apply_expert_sliced(init_params(sliced, jax.random.key(0)), x, sliced, Mesh(devices[:4], ("expert",)))
