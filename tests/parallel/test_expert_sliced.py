"""`parallel.moe_apply_expert_sliced`: experts split over a mesh axis, tokens replicated, one all-reduce. It equals
`moe_apply` on one device (outputs, aux and gradients; float32: 1e-5) for every dropless implementation, the
capacity path, Tutel and router gates, shared experts and packed (quantized) experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tutel_jax.layer import make_config, init_params, moe_apply
from tutel_jax.parallel import moe_apply_expert_sliced
from tutel_jax.parallel._expert_sliced import local_plan
from tutel_jax.native import _build as build
from tutel_jax.routing import plan_from_choices

TOP2 = {"type": "top", "k": 2}
DEEPSEEK = {"type": "deepseek_v3", "k": 3, "n_group": 4, "topk_group": 2, "correction_bias": True,
            "routed_scaling_factor": 2.0}
SWIGLU = {"type": "swiglu", "count_per_node": 16, "hidden_size_per_expert": 32}
# the native CPU kernel is compiled on first use: it needs a C++ compiler (tests/native/test_native_moe.py)
NATIVE = pytest.param("native", marks=pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler"))


def _mesh(shape=(4,), axes=("expert",)):
    return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), axes)


def _layer(gate=TOP2, experts=SWIGLU, **kw):
    config = make_config(gate, 64, experts, **kw)
    return config, init_params(config, jax.random.key(0))


def _close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol * max(1.0, float(np.abs(b).max())))


def test_local_plans_partition_the_assignments():
    """Each device's plan keeps exactly the assignments to its experts, renumbered, with the global slot."""
    ids = jnp.asarray([[0, 5, 7, 2], [3, 6, 1, 4]], jnp.int32)  # [k=2, S=4] over E=8
    plan = plan_from_choices(ids, jnp.full(ids.shape, 0.5), 8, 0.0)
    seen = np.zeros(ids.shape, int)
    for w in range(4):
        mine = local_plan(plan, jnp.int32(2 * w), 2)
        assert mine.num_experts == 2
        np.testing.assert_array_equal(mine.dispatch_count, np.asarray(plan.dispatch_count)[2 * w:2 * w + 2])
        here = (np.asarray(ids) // 2) == w
        seen += here
        np.testing.assert_array_equal(np.asarray(mine.gates) > 0, here)
        np.testing.assert_array_equal(np.asarray(mine.expert_ids)[here], np.asarray(ids)[here] - 2 * w)
        np.testing.assert_array_equal(np.asarray(mine.locations)[here], np.asarray(plan.locations)[here])
        assert (np.asarray(mine.locations)[~here] >= 2 ** 30).all()
    np.testing.assert_array_equal(seen, 1)


@pytest.mark.parametrize("impl", ["loop", "bucketed", "ragged", "gather", NATIVE])
@pytest.mark.parametrize("gate", [TOP2, DEEPSEEK], ids=["top2", "deepseek_top3"])
def test_dropless_equals_one_device(impl, gate):
    config, params = _layer(gate, dropless_impl=impl)
    x = jax.random.normal(jax.random.key(1), (3, 5, 64))
    mesh = _mesh()
    ref, ref_aux = moe_apply(params, x, config, capacity_factor=0.0)
    fn = jax.jit(lambda p, x: moe_apply_expert_sliced(p, x, config, mesh, capacity_factor=0.0))
    y, aux = fn(params, x)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    _close(y, ref)
    np.testing.assert_array_equal(aux.dispatch_count, ref_aux.dispatch_count)
    _close(aux.l_aux, ref_aux.l_aux)


def test_capacity_path_drops_like_one_device():
    """capacity_factor > 0: each device lays out the global capacity; dropped assignments match."""
    config, params = _layer(TOP2)
    x = jax.random.normal(jax.random.key(2), (40, 64))
    ref, ref_aux = moe_apply(params, x, config, capacity_factor=0.5)
    mesh = _mesh()
    y, aux = jax.jit(lambda p, x: moe_apply_expert_sliced(p, x, config, mesh, capacity_factor=0.5))(params, x)
    assert float(ref_aux.dropped_fraction) > 0
    _close(y, ref)
    _close(aux.dropped_fraction, ref_aux.dropped_fraction)


def test_shared_experts_and_a_data_axis():
    """Shared experts are added once (after the all-reduce); a second mesh axis sees the same tokens."""
    config, params = _layer(DEEPSEEK, dict(SWIGLU, shared={"hidden_size": 48, "gate": True}), dropless_impl="loop")
    assert "shared_experts" in params
    x = jax.random.normal(jax.random.key(3), (6, 64))
    ref = moe_apply(params, x, config, capacity_factor=0.0)[0]
    mesh = _mesh((2, 4), ("data", "expert"))
    y = jax.jit(lambda p, x: moe_apply_expert_sliced(p, x, config, mesh, capacity_factor=0.0)[0])(params, x)
    _close(y, ref)


def test_packed_experts_sharded_in_place():
    """MXFP4 experts (uint8 blocks + scales) placed shard by shard stay on their devices."""
    config, params = _layer(TOP2, dict(SWIGLU, weight_format="mxfp4"), dropless_impl="loop")
    mesh = _mesh()
    placed = dict(params, experts=jax.tree_util.tree_map(
        lambda a: jax.device_put(a, NamedSharding(mesh, P("expert"))), params["experts"]))
    x = jax.random.normal(jax.random.key(4), (7, 64))
    ref = moe_apply(params, x, config, capacity_factor=0.0)[0]
    y = jax.jit(lambda p, x: moe_apply_expert_sliced(p, x, config, mesh, capacity_factor=0.0)[0])(placed, x)
    _close(y, ref)


@pytest.mark.parametrize("impl", ["loop", "bucketed", NATIVE])
def test_gradients_equal_one_device(impl):
    """Through shard_map's transpose: the replicated gate and input get the sum over devices, each expert
    its own device's gradient."""
    config, params = _layer(DEEPSEEK, dropless_impl=impl)
    x = jax.random.normal(jax.random.key(5), (9, 64))
    mesh = _mesh()
    loss_ref = lambda p, x: jnp.sum(jnp.sin(moe_apply(p, x, config, capacity_factor=0.0)[0]))
    loss = lambda p, x: jnp.sum(jnp.sin(moe_apply_expert_sliced(p, x, config, mesh, capacity_factor=0.0)[0]))
    ref = jax.grad(loss_ref, argnums=(0, 1))(params, x)
    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    ref_leaves, got_leaves = jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(got)
    assert len(ref_leaves) == len(got_leaves)
    for a, b in zip(got_leaves, ref_leaves):
        _close(a, b)


def test_one_all_reduce_and_no_gathered_weights():
    config, params = _layer(TOP2, dropless_impl="loop")
    mesh = _mesh()
    placed = dict(params, experts=jax.tree_util.tree_map(
        lambda a: jax.device_put(a, NamedSharding(mesh, P("expert"))), params["experts"]))
    x = jnp.ones((4, 64))
    fn = jax.jit(lambda p, x: moe_apply_expert_sliced(p, x, config, mesh, capacity_factor=0.0)[0])
    hlo = fn.lower(placed, x).compile().as_text()
    lines = hlo.splitlines()
    assert not [line for line in lines if " all-gather(" in line or "all-gather-start(" in line]
    reduces = [line for line in lines if " all-reduce(" in line or "all-reduce-start(" in line]
    assert len(reduces) == 1 and "f32[4,64]" in reduces[0], reduces


def test_bad_mesh_is_a_clear_error():
    config, params = _layer(TOP2)
    x = jnp.ones((4, 64))
    with pytest.raises(ValueError, match="16 experts cannot be split over mesh axis 'expert' of size 3"):
        moe_apply_expert_sliced(params, x, config, _mesh((3,)))
    with pytest.raises(ValueError, match="expert_axis 'ep' is not an axis"):
        moe_apply_expert_sliced(params, x, config, _mesh(), "ep")
