"""Expert parallelism on 8 fake CPU devices: the shard_map'd layer equals the single-device layer run on each
device's tokens (outputs and every gradient, float32 <= 1e-5), for flat and 2DH all_to_all, overlap degrees,
top-1/2/3 and capacity factors > 0, 0, < 0; unequal token counts; overlap visible in the compiled HLO."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tutel_jax import init_params, make_config, moe_apply
from tutel_jax.parallel import (ExpertParallel, moe_apply_parallel, shard_params, expert_all_to_all,
                                expert_all_to_all_reverse, shard_map)

M, H = 16, 16
DEVICES = np.array(jax.devices()[:8])


def _flat():
    return ExpertParallel(Mesh(DEVICES, ("expert",)))


def _2dh():
    return ExpertParallel(Mesh(DEVICES.reshape(2, 4), ("node", "local")), expert_axes=("node", "local"))


def _config(k, cf, n, W, expert_type="ffn", **kw):
    return make_config({"type": "top", "k": k, "capacity_factor": cf}, M,
                       {"type": expert_type, "count_per_node": n, "hidden_size_per_expert": H}, world_size=W, **kw)


def _assert_trees_close(actual, expected):
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree.leaves(expected)):
        a, b = np.asarray(a), np.asarray(b)
        scale = max(np.abs(b).max(), 1e-30)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


def _compare(placement, k, cf, d, n=2, per_device_batch=2, use_2dh=False, adaptive_r=None, expert_type="ffn",
             parallel_type="adaptive:1"):
    W = placement.world_size
    config = _config(k, cf, n, W, expert_type, parallel_type=parallel_type)
    params = init_params(config, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (per_device_batch * W, 6, M))
    up = jax.random.normal(jax.random.key(2), x.shape)

    def loss_parallel(p, x):
        y, aux = moe_apply_parallel(p, x, config, placement, a2a_ffn_overlap_degree=d, use_2dh=use_2dh,
                                    adaptive_r=adaptive_r)
        return jnp.sum(y * up) + 0.1 * aux.l_aux, (y, aux)

    def loss_single(p, x):  # what each device computes, run shard by shard on one device
        ys, losses, counts = [], [], []
        for r in range(W):
            sl = slice(r * per_device_batch, (r + 1) * per_device_batch)
            y, aux = moe_apply(p, x[sl], config, a2a_ffn_overlap_degree=d)
            ys.append(y), losses.append(aux.l_aux), counts.append(aux.dispatch_count)
        y = jnp.concatenate(ys)
        return jnp.sum(y * up) + 0.1 * jnp.mean(jnp.stack(losses)), (y, sum(counts))

    (l1, (y1, aux1)), g1 = jax.jit(jax.value_and_grad(loss_parallel, (0, 1), has_aux=True))(
        shard_params(params, placement, config), x)
    (l2, (y2, counts2)), g2 = jax.jit(jax.value_and_grad(loss_single, (0, 1), has_aux=True))(params, x)
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y2), rtol=1e-5, atol=1e-6)
    # the loss sums y*up over all elements in a different order: allow eps_f32 per summed term
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-5, atol=1.2e-7 * y2.size)
    np.testing.assert_array_equal(np.asarray(aux1.dispatch_count), np.asarray(counts2))
    _assert_trees_close(g1, g2)
    return aux1


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("cf", [1.0, 0.0, -0.5])
def test_flat_expert_parallel_equals_single_device(k, cf):
    aux = _compare(_flat(), k, cf, d=1)
    if cf == 0:
        assert float(aux.dropped_fraction) == 0.0


@pytest.mark.parametrize("k,cf,d", [(2, 1.0, 2), (2, 1.0, 4), (1, 0.5, 2), (3, 0.0, 4), (2, -0.5, 2)])
def test_overlap_degree_equals_single_device(k, cf, d):
    aux = _compare(_flat(), k, cf, d=d)
    assert int(aux.capacity) % d == 0


@pytest.mark.parametrize("k,cf,d", [(2, 1.0, 1), (1, 0.0, 2), (3, -0.5, 1)])
def test_2dh_equals_single_device(k, cf, d):
    _compare(_2dh(), k, cf, d=d, use_2dh=True)


@pytest.mark.parametrize("s,r,k,cf,d,expert_type", [
    (2, 0, 2, 1.0, 1, "ffn"), (2, 1, 1, 0.0, 1, "ffn"), (2, 2, 2, 1.0, 2, "ffn"),
    (4, 0, 3, -0.5, 1, "llama_ffn"), (4, 1, 2, 1.0, 2, "ffn"), (4, 2, 1, 1.0, 1, "ffn"), (4, 4, 2, 0.0, 1, "ffn"),
    (8, 0, 1, 1.0, 1, "ffn"), (8, 1, 2, -0.5, 1, "ffn"), (8, 2, 2, 1.0, 1, "llama_ffn"), (8, 4, 3, 1.0, 1, "ffn"),
    (8, 8, 2, 1.0, 2, "ffn"),
])
def test_sharded_experts_every_adaptive_r_equals_single_device(s, r, k, cf, d, expert_type):
    """count_per_node = -s: E = 8 / s experts, each split over s devices; Tutel's adaptive:r for every r."""
    _compare(_flat(), k, cf, d=d, n=-s, adaptive_r=r, expert_type=expert_type)


@pytest.mark.parametrize("parallel_type", ["data", "model", "adaptive:2"])
def test_parallel_type_names(parallel_type):
    _compare(_flat(), 2, 1.0, d=1, n=-4, parallel_type=parallel_type)


def test_data_parallel_r0_with_whole_experts_per_device():
    _compare(_flat(), 2, 1.0, d=1, n=1, adaptive_r=0)


def test_invalid_adaptive_r_refused():
    with pytest.raises(ValueError, match=r"adaptive_r must be one of \[0, 1, 2, 4\]"):
        _config(2, 1.0, -4, 8, parallel_type="adaptive:3")
    config = _config(2, 1.0, -4, 8)
    params = init_params(config, jax.random.key(0))
    with pytest.raises(ValueError, match="adaptive_r"):
        moe_apply_parallel(params, jnp.zeros((8, 2, M)), config, _flat(), adaptive_r=8)


def test_sharded_expert_parameters_hold_one_slice_per_device():
    config = _config(2, 1.0, -4, 8)
    params = shard_params(init_params(config, jax.random.key(0)), _flat(), config)
    fc1 = params["experts"]["batched_fc1_w"]
    assert fc1.shape == (2, H, M)
    assert {sh.data.shape for sh in fc1.addressable_shards} == {(1, H // 4, M)}


def test_2dh_all_to_all_equals_flat_bitwise():
    mesh = Mesh(DEVICES.reshape(2, 4), ("node", "local"))
    buf = jax.random.normal(jax.random.key(0), (8 * 8, 2 * 3, 5))  # per device [E=16, C=3, M=5]

    def both(b):
        flat = expert_all_to_all(b, ("node", "local"))
        hier = expert_all_to_all(b, ("node", "local"), use_2dh=True)
        back = expert_all_to_all_reverse(hier, ("node", "local"), use_2dh=True)
        return flat, hier, back

    spec = P(("node", "local"))
    flat, hier, back = jax.jit(shard_map(both, mesh, (spec,), (spec, spec, spec)))(buf)
    np.testing.assert_array_equal(np.asarray(flat), np.asarray(hier))
    np.testing.assert_array_equal(np.asarray(back), np.asarray(buf))


def test_one_expert_per_device_and_many_tokens():
    _compare(_flat(), 2, 1.0, d=1, n=1, per_device_batch=3)


def test_unequal_token_counts_agree_on_capacity():
    placement, W = _flat(), 8
    config = _config(2, 1.0, 1, W)
    params = init_params(config, jax.random.key(0))
    T = 10
    x = jax.random.normal(jax.random.key(1), (W, T, M))
    counts = np.array([10, 3, 7, 10, 1, 5, 8, 2])  # real tokens per device; the rest is padding
    valid = jnp.asarray(np.arange(T)[None, :] < counts[:, None])
    fn = jax.jit(lambda p, x, v, ineq: moe_apply_parallel(p, x, config, placement, valid=v, inequivalent_tokens=ineq),
                 static_argnums=3)
    y, aux = fn(shard_params(params, placement), x, valid, True)
    # agreed capacity: from the largest count (10 tokens): k * int(cf * ceil(10 / 8)) = 4
    assert int(aux.capacity) == 4
    for r in range(W):
        c = counts[r]
        # the same tokens alone on one device, with the capacity computed from the largest device's count
        y_ref, _ = jax.jit(lambda p, t: _single_with_capacity_tokens(p, t, config, T))(params, x[r, :c])
        np.testing.assert_allclose(np.asarray(y[r, :c]), np.asarray(y_ref), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(y[r, c:]), 0)  # padding tokens output 0
    assert int(aux.dispatch_count.sum()) == 2 * counts.sum()
    # without agreement each device uses its own count; still no hang, same shapes
    y2, aux2 = fn(shard_params(params, placement), x, valid, False)
    assert y2.shape == y.shape


def _single_with_capacity_tokens(params, tokens, config, capacity_tokens):
    """The single-device layer on `tokens`, with the capacity computed as if there were `capacity_tokens`."""
    from tutel_jax.routing import _dispatch as dispatch
    from tutel_jax.layer import route
    plan, _ = route(params["gates"][0], tokens, config, num_tokens_for_capacity=capacity_tokens)
    buf = dispatch.fast_encode(tokens, plan)
    out = config.experts.batched(params["experts"], buf)
    return dispatch.fast_decode(out, plan), None


@pytest.mark.parametrize("d", [1, 2, 4])
def test_overlap_chunks_are_independent_all_to_alls_in_hlo(d):
    placement = _flat()
    config = _config(2, 1.0, 2, 8)
    params = shard_params(init_params(config, jax.random.key(0)), placement)
    x = jax.random.normal(jax.random.key(1), (16, 8, M))
    hlo = jax.jit(lambda p, x: moe_apply_parallel(p, x, config, placement, a2a_ffn_overlap_degree=d)[0]).lower(
        params, x).compile().as_text()
    assert hlo.count("all-to-all(") == 2 * d  # d forward and d reverse exchanges, one per chunk


def test_moe_inside_a_larger_model_with_tensor_parallel_layers():
    """EP over 'expert' (4) while a dense layer is tensor-parallel over 'model' (2); tokens replicated on 'model'."""
    mesh = Mesh(DEVICES.reshape(4, 2), ("expert", "model"))
    placement = ExpertParallel(mesh, expert_axes=("expert",), token_axes=("expert",))
    config = _config(2, 1.0, 2, 4)
    params = init_params(config, jax.random.key(0))
    dense = jax.random.normal(jax.random.key(3), (M, 32)) * 0.1
    x = jax.random.normal(jax.random.key(1), (8, 5, M))

    def model(p, w, x):
        y, aux = moe_apply_parallel(p, x, config, placement)
        h = jax.nn.relu((x + y) @ w)  # w sharded over 'model' on its output axis
        return jnp.mean(h ** 2) + 0.01 * aux.l_aux

    def model_ref(p, w, x):
        ys, ls = [], []
        for r in range(4):
            y, aux = moe_apply(p, x[2 * r:2 * r + 2], config)
            ys.append(y), ls.append(aux.l_aux)
        h = jax.nn.relu((x + jnp.concatenate(ys)) @ w)
        return jnp.mean(h ** 2) + 0.01 * jnp.mean(jnp.stack(ls))

    w_sharded = jax.device_put(dense, NamedSharding(mesh, P(None, "model")))
    l1, g1 = jax.jit(jax.value_and_grad(model, (0, 1)))(shard_params(params, placement), w_sharded, x)
    l2, g2 = jax.jit(jax.value_and_grad(model_ref, (0, 1)))(params, dense, x)
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-5)
    _assert_trees_close(g1, g2)


def test_bad_placements_and_shapes():
    mesh = Mesh(DEVICES, ("expert",))
    with pytest.raises(ValueError, match="not in the mesh"):
        ExpertParallel(mesh, expert_axes=("ep",))
    mesh2 = Mesh(DEVICES.reshape(4, 2), ("expert", "model"))
    with pytest.raises(ValueError, match="must also be token axes"):
        ExpertParallel(mesh2, expert_axes=("expert",), token_axes=("model",))
    placement = _flat()
    config = _config(2, 1.0, 2, 4)  # built for W=4, mesh has 8
    params = init_params(config, jax.random.key(0))
    with pytest.raises(ValueError, match="world_size=8"):
        moe_apply_parallel(params, jnp.zeros((8, 2, M)), config, placement)
    config = _config(2, 1.0, 2, 8)
    params = init_params(config, jax.random.key(0))
    with pytest.raises(ValueError, match="divisible by the 8 token shards"):
        moe_apply_parallel(params, jnp.zeros((6, 2, M)), config, placement)
    with pytest.raises(ValueError, match="model_dim=16"):
        moe_apply_parallel(params, jnp.zeros((8, 2, M + 1)), config, placement)


def test_nnx_module_with_expert_parallel_group_trains_like_per_device_layers():
    import optax
    from flax import nnx

    from tutel_jax import MoE
    placement = _flat()
    kwargs = dict(gate_type={"type": "top", "k": 2}, model_dim=M,
                  experts={"type": "ffn", "count_per_node": 1, "hidden_size_per_expert": H}, seeds=(1, 2, 3))
    layer = MoE(**kwargs, group=placement)
    assert layer.num_global_experts == 8
    fc1 = layer.param_tree()["experts"]["batched_fc1_w"]
    assert fc1.shape == (8, H, M) and fc1.sharding.spec == P(("expert",))
    assert {s.data.shape for s in fc1.addressable_shards} == {(1, H, M)}  # one expert per device, no copies
    # the same parameters on one device
    single = MoE(**dict(kwargs, experts=dict(kwargs["experts"], count_per_node=8)))
    single.load_state_dict(layer.state_dict())
    x = jax.random.normal(jax.random.key(1), (16, 4, M))

    def train(model, step_fn_x):
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

        @nnx.jit
        def step(model, opt):
            def loss_fn(model):
                return jnp.mean(step_fn_x(model) ** 2) + 0.01 * model.l_aux
            loss, grads = nnx.value_and_grad(loss_fn)(model)
            opt.update(model, grads)
            return loss
        return [float(step(model, opt)) for _ in range(3)]

    ep_losses = train(layer, lambda m: m(x))

    def per_device(m):  # each device's 2 samples routed on their own, l_aux averaged like the EP layer
        ys, ls = [], []
        for r in range(8):
            ys.append(m(x[2 * r:2 * r + 2]))
            ls.append(m.l_aux)
        m._l_aux.set_value(jnp.mean(jnp.stack(ls)))
        return jnp.concatenate(ys)

    single_losses = train(single, per_device)
    np.testing.assert_allclose(ep_losses, single_losses, rtol=1e-5)
    assert ep_losses[-1] < ep_losses[0]


def test_nnx_model_with_tensor_parallel_linear_and_expert_parallel_moe():
    """A Flax NNX model: a Linear sharded over 'model' around an MoE layer whose experts are split over 'expert'."""
    import optax
    from flax import nnx

    from tutel_jax import MoE
    mesh = Mesh(DEVICES.reshape(4, 2), ("expert", "model"))
    placement = ExpertParallel(mesh, expert_axes=("expert",), token_axes=("expert",))

    class Block(nnx.Module):
        def __init__(self, group, n, rngs):
            self.moe = MoE(gate_type={"type": "top", "k": 2}, model_dim=M,
                           experts={"type": "ffn", "count_per_node": n, "hidden_size_per_expert": H},
                           seeds=(1, 2, 3), group=group)
            self.out = nnx.Linear(M, 32, rngs=rngs)

        def __call__(self, x):
            return self.out(x + self.moe(x))

    model = Block(placement, 2, nnx.Rngs(0))
    kernel = model.out.kernel
    kernel.set_value(jax.device_put(kernel[...], NamedSharding(mesh, P(None, "model"))))
    reference = Block(None, 8, nnx.Rngs(0))
    reference.moe.load_state_dict(model.moe.state_dict())
    x = jax.random.normal(jax.random.key(1), (8, 3, M))

    def run(model, per_device):
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

        @nnx.jit
        def step(model, opt):
            def loss_fn(model):
                if not per_device:
                    return jnp.mean(model(x) ** 2) + 0.01 * model.moe.l_aux
                outs, losses = [], []
                for r in range(4):  # each expert-axis device routes its own 2 samples
                    outs.append(model(x[2 * r:2 * r + 2]))
                    losses.append(model.moe.l_aux)
                return jnp.mean(jnp.concatenate(outs) ** 2) + 0.01 * jnp.mean(jnp.stack(losses))
            loss, grads = nnx.value_and_grad(loss_fn)(model)
            opt.update(model, grads)
            return loss
        return [float(step(model, opt)) for _ in range(3)]

    np.testing.assert_allclose(run(model, False), run(reference, True), rtol=1e-5)
    assert model.out.kernel[...].sharding.spec == P(None, "model")
