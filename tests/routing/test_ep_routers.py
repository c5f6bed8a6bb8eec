"""Expert parallelism with modern routers, GLU experts and shared experts on 8 fake CPU devices: the shard_map'd
layer equals the single-device layer run on each device's tokens (outputs, every gradient, aux losses), for
DeepSeek-style and GPT-OSS-style layers with shared experts, expert choice, sharded GLU experts, and the bucketed
padded all_to_all of the dropless path up to its top bucket (S_local)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from tutel_jax import init_params, make_config, moe_apply
from tutel_jax.parallel import ExpertParallel, moe_apply_parallel, shard_params, ragged_supported

M, H = 16, 8
PLACEMENT = ExpertParallel(Mesh(np.array(jax.devices()[:8]), ("expert",)))
W = 8

DEEPSEEK = {"type": "deepseek_v3", "k": 2, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}
GPT_OSS = {"type": "gpt_oss", "k": 2}


def _assert_trees_close(actual, expected):
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree.leaves(expected)):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * max(np.abs(b).max(), 1e-30),
                                   err_msg=jax.tree_util.keystr(path))


#: single-device results by layer (the tests comparing other exchanges against the same layer share one)
_SINGLE: dict[str, tuple] = {}


def _compare(gate, experts, cf, n=2, adaptive_r=None, d=1, bias=None, per_device_batch=2, **parallel_kw):
    config = make_config(gate, M, {**experts, "count_per_node": n, "hidden_size_per_expert": H}, world_size=W)
    params = init_params(config, jax.random.key(0))
    if bias is not None:
        params["gates"][0]["e_score_correction_bias"] = bias
    x = jax.random.normal(jax.random.key(1), (per_device_batch * W, 6, M))
    up = jax.random.normal(jax.random.key(2), x.shape)

    def loss_parallel(p, x):
        y, aux = moe_apply_parallel(p, x, config, PLACEMENT, capacity_factor=cf, adaptive_r=adaptive_r,
                                    a2a_ffn_overlap_degree=d, **parallel_kw)
        return jnp.sum(y * up) + 0.1 * aux.l_aux, (y, aux)

    def loss_single(p, x):
        ys, auxes = [], []
        for r in range(W):
            y, aux = moe_apply(p, x[r * per_device_batch:(r + 1) * per_device_batch], config, capacity_factor=cf,
                               a2a_ffn_overlap_degree=d)
            ys.append(y), auxes.append(aux)
        l_aux = jnp.mean(jnp.stack([a.l_aux for a in auxes]))
        losses = jax.tree.map(lambda *v: jnp.mean(jnp.stack(v)), *[a.losses for a in auxes])
        y = jnp.concatenate(ys)
        return jnp.sum(y * up) + 0.1 * l_aux, (y, sum(a.dispatch_count for a in auxes), losses)

    (l1, (y1, aux1)), g1 = jax.jit(jax.value_and_grad(loss_parallel, (0, 1), has_aux=True))(
        shard_params(params, PLACEMENT, config), x)
    key = repr((gate, experts, cf, n, d, None if bias is None else np.asarray(bias).tolist(), per_device_batch))
    if key not in _SINGLE:
        _SINGLE[key] = jax.jit(jax.value_and_grad(loss_single, (0, 1), has_aux=True))(params, x)
    (l2, (y2, counts2, losses2)), g2 = _SINGLE[key]
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y2), rtol=1e-5, atol=1e-5 * np.abs(y2).max())
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-5, atol=1.2e-7 * y2.size)
    np.testing.assert_array_equal(np.asarray(aux1.dispatch_count), np.asarray(counts2))
    _assert_trees_close(aux1.losses, losses2)
    _assert_trees_close(g1, g2)
    return aux1


@pytest.mark.parametrize("cf", [0.0, 1.0])
def test_deepseek_layer_with_shared_experts(cf):
    aux = _compare(DEEPSEEK, {"type": "swiglu", "shared": {"hidden_size": 8}}, cf)
    if cf == 0:
        assert float(aux.dropped_fraction) == 0.0


@pytest.mark.parametrize("cf", [0.0, -0.5])
def test_gpt_oss_layer_with_gated_shared_experts(cf):
    _compare(GPT_OSS, {"type": "gpt_oss", "swiglu_limit": 1.0, "shared": {"hidden_size": 8, "gate": True}}, cf)


def test_dropless_top_bucket_when_one_expert_takes_everything():
    """Every token picks expert 5 (bias): each device sends S_local assignments there, the top bucket."""
    bias = jnp.zeros((16,)).at[5].set(10.0)
    aux = _compare(DEEPSEEK, {"type": "swiglu", "shared": {"hidden_size": 8}}, 0.0, bias=bias, d=2)
    assert int(aux.capacity) == 12 and float(aux.dropped_fraction) == 0.0  # S_local = 2 * 6 tokens


def test_expert_choice_layer():
    _compare({"type": "expert_choice", "capacity_factor": 2.0}, {"type": "swiglu"}, 2.0, n=1)


@pytest.mark.parametrize("experts,n,r", [({"type": "gpt_oss", "swiglu_limit": 1.0}, -2, 2),
                                         ({"type": "gpt_oss", "swiglu_limit": 1.0}, -2, 1),
                                         ({"type": "swiglu", "shared": {"hidden_size": 8}}, -4, 4)])
def test_sharded_glu_experts(experts, n, r):
    """Experts split over devices along their hidden axis (GPT-OSS's interleaved gate/up, SwiGLU's [M, 2, I])."""
    _compare({"type": "mixtral", "k": 2}, experts, 1.0, n=n, adaptive_r=r)


@pytest.mark.parametrize("recv_capacity", [None, 4])
def test_ragged_exchange_algorithm_emulated_on_cpu(recv_capacity):
    """The ragged_all_to_all dropless path (offsets, regrouping, reverse exchange, gradients) with the collective
    emulated by a padded all_to_all; recv_capacity=4 is too small, so the padded fallback runs."""
    _compare(DEEPSEEK, {"type": "swiglu", "shared": {"hidden_size": 8}}, 0.0, dropless_exchange="emulated",
             recv_capacity=recv_capacity)


def test_ragged_all_to_all_lowers_forward_and_backward():
    """XLA:CPU cannot compile ragged_all_to_all; check the real primitive is in the lowered program (forward and
    gradient) so a GPU/TPU run compiles the same code. Compiling and running it needs a GPU or TPU."""
    assert not ragged_supported("cpu") and ragged_supported("gpu")
    config = make_config(GPT_OSS, M, {"type": "gpt_oss", "count_per_node": 2, "hidden_size_per_expert": H},
                         world_size=W)
    params = shard_params(init_params(config, jax.random.key(0)), PLACEMENT, config)
    x = jnp.zeros((2 * W, 6, M))

    def loss(p, x):
        y, _ = moe_apply_parallel(p, x, config, PLACEMENT, capacity_factor=0.0, dropless_exchange="ragged")
        return jnp.sum(y)

    forward = jax.jit(loss).lower(params, x).as_text()
    backward = jax.jit(jax.grad(loss, (0, 1))).lower(params, x).as_text()
    assert forward.count("ragged_all_to_all") >= 2  # there and back
    assert backward.count("ragged_all_to_all") >= 4  # and the transposes
    with pytest.raises(ValueError, match="dropless_exchange"):
        moe_apply_parallel(params, x, config, PLACEMENT, capacity_factor=0.0, dropless_exchange="nccl")
