"""The 'gather' (each assignment through its own expert's gathered weights) and 'loop' (the used experts one
at a time) dropless paths equal the ragged path for float and quantized SwiGLU / GPT-OSS experts, outputs and
gradients (float32: 1e-5); 'auto' picks 'loop' on CPU for k*S <= 32E."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quant import FORMATS
from tutel_jax.experts import _dropless as dropless
from tutel_jax.layer import make_config, init_params, moe_apply
from tutel_jax.native._build import int8_pays_off

EXPERTS = {
    "swiglu": {"type": "swiglu", "count_per_node": 16, "hidden_size_per_expert": 32},
    "gpt_oss": {"type": "gpt_oss", "count_per_node": 16, "hidden_size_per_expert": 32},
    "swiglu_mxfp4": {"type": "swiglu", "count_per_node": 16, "hidden_size_per_expert": 32, "weight_format": "mxfp4"},
    "gpt_oss_fp8": {"type": "gpt_oss", "count_per_node": 16, "hidden_size_per_expert": 32,
                    "weight_format": "fp8_block"},
}
GATES = [{"type": "top", "k": 2}, {"type": "deepseek_v3", "k": 3, "n_group": 4, "topk_group": 2,
                                    "correction_bias": True, "routed_scaling_factor": 2.0}]


def _layer(experts, gate, impl):
    config = make_config(gate, 64, EXPERTS[experts], dropless_impl=impl)
    return config, init_params(config, jax.random.key(0))


@pytest.mark.parametrize("gate", GATES, ids=["tutel_top2", "deepseek_top3"])
@pytest.mark.parametrize("experts", sorted(EXPERTS))
def test_gather_equals_ragged(experts, gate):
    x = jax.random.normal(jax.random.key(1), (2, 3, 64))
    ys = {}
    for impl in ("ragged", "gather"):
        config, params = _layer(experts, gate, impl)
        ys[impl] = np.asarray(jax.jit(lambda p, x: moe_apply(p, x, config, capacity_factor=0.0)[0])(params, x))
    np.testing.assert_allclose(ys["gather"], ys["ragged"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("experts", ["swiglu", "gpt_oss"])
def test_gather_gradients_equal_ragged(experts):
    x = jax.random.normal(jax.random.key(2), (5, 64))
    grads = {}
    for impl in ("ragged", "gather"):
        config, params = _layer(experts, GATES[0], impl)
        loss = lambda p, x: jnp.sum(moe_apply(p, x, config, capacity_factor=0.0)[0] ** 2)
        grads[impl] = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    for a, b in zip(jax.tree_util.tree_leaves(grads["gather"]), jax.tree_util.tree_leaves(grads["ragged"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_auto_picks_loop_for_few_assignments_on_cpu():
    config, _ = _layer("swiglu", GATES[0], "auto")
    assert dropless.resolve_impl("auto", config.experts, num_assignments=512, num_experts=16) == "loop"
    assert dropless.resolve_impl("auto", config.experts, num_assignments=513, num_experts=16) == "bucketed"
    ffn = make_config({"type": "top", "k": 1}, 8, {"type": "ffn", "count_per_node": 4, "hidden_size_per_expert": 8})
    assert dropless.resolve_impl("auto", ffn.experts, 1, 4) == "loop"
    assert dropless.resolve_impl("gather", ffn.experts) == "gather"  # every built-in type has gathered()
    for fmt in FORMATS:  # quantized: never a whole layer dequantized, whatever the batch
        packed = make_config({"type": "top", "k": 2}, 64, {"type": "swiglu", "count_per_node": 4,
                                                          "hidden_size_per_expert": 32, "weight_format": fmt})
        # the native kernel where it can be built (decoded in registers), else the loop
        want = "loop"
        if dropless.native_available(packed.experts):
            want = "native_int8" if fmt in ("mxfp4", "nvfp4") and int8_pays_off() else "native"
        assert dropless.resolve_impl("auto", packed.experts, num_assignments=10**6, num_experts=4) == want

    class BatchedOnly:  # the minimal custom-expert protocol: no gathered()
        def init(self, key, model_dim, num_experts, dtype):
            return {}

        def batched(self, params, x):
            return x

    minimal = make_config({"type": "top", "k": 1}, 8, BatchedOnly())
    with pytest.raises(ValueError, match="gathered"):
        dropless.resolve_impl("gather", minimal.experts)
    with pytest.raises(ValueError, match="dropless_impl"):
        make_config({"type": "top", "k": 1}, 8, EXPERTS["swiglu"], dropless_impl="dense")


@pytest.mark.parametrize("gate", GATES, ids=["tutel_top2", "deepseek_top3"])
@pytest.mark.parametrize("experts", ["swiglu", "gpt_oss", "swiglu_mxfp4", "gpt_oss_fp8"])
def test_loop_equals_ragged(experts, gate):
    """'loop' (the used experts one at a time, in row chunks) equals the ragged path: outputs, and gradients
    for the parameters and the input (float experts) or the input (packed experts); float32: 1e-5."""
    x = jax.random.normal(jax.random.key(3), (10, 64))  # k*S = 20 or 30 rows over 16 experts
    packed = "_" in experts
    results = {}
    for impl in ("ragged", "loop"):
        config, params = _layer(experts, gate, impl)
        loss = lambda p, x: jnp.sum(jnp.sin(moe_apply(p, x, config, capacity_factor=0.0)[0]))
        y = jax.jit(lambda p, x: moe_apply(p, x, config, capacity_factor=0.0)[0])(params, x)
        g = jax.jit(jax.grad(loss, argnums=1 if packed else (0, 1)))(params, x)
        results[impl] = (np.asarray(y), g)
    np.testing.assert_allclose(results["loop"][0], results["ragged"][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(results["loop"][1]), jax.tree_util.tree_leaves(results["ragged"][1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 2, 8])
def test_expert_loop_equals_grouped(chunk):
    """expert_loop.grouped equals experts.grouped for groups of 0..5 rows, any chunk size (values and VJP)."""
    from tutel_jax.experts import _loop as expert_loop

    config, params = _layer("gpt_oss", GATES[0], "ragged")
    sizes = jnp.asarray([3, 0, 1, 0, 5, 2, 0, 3, 0, 0, 0, 0, 0, 0, 0, 1], jnp.int32)
    rows = jax.random.normal(jax.random.key(6), (int(sizes.sum()), 64))
    ours = lambda p, r: expert_loop.grouped(config.experts, p, r, sizes, chunk)
    ref = lambda p, r: config.experts.grouped(p, r, sizes)
    np.testing.assert_allclose(np.asarray(ours(params["experts"], rows)), np.asarray(ref(params["experts"], rows)),
                               rtol=1e-5, atol=1e-5)
    ct = jax.random.normal(jax.random.key(7), rows.shape)
    g_ours = jax.vjp(ours, params["experts"], rows)[1](ct)
    g_ref = jax.vjp(ref, params["experts"], rows)[1](ct)
    for a, b in zip(jax.tree_util.tree_leaves(g_ours), jax.tree_util.tree_leaves(g_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert expert_loop.chunk_rows(32, 32) == 2 and expert_loop.chunk_rows(128, 32) == 4
    assert expert_loop.chunk_rows(4, 32) == 2 and expert_loop.chunk_rows(4096, 32) == 8


def test_loop_runs_only_the_used_experts():
    """The loop runs each used expert's chunks and no idle expert: a counting wrapper around the experts sees
    one call per chunk of the distinct chosen experts, and NaN weights in every idle expert leave the output
    equal to the ragged path's (with clean weights)."""
    import dataclasses

    from tutel_jax.layer import route

    config, params = _layer("swiglu", GATES[0], "loop")
    x = jax.random.normal(jax.random.key(5), (3, 64))  # 6 assignments over 16 experts
    plan, _ = route(params["gates"][0], x, config, capacity_factor=0.0)
    used, counts = np.unique(np.asarray(plan.expert_ids), return_counts=True)
    ran = []

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def batched(self, p, buf):
            jax.debug.callback(lambda n: ran.append(int(n)), buf.shape[0])
            return self.inner.batched(p, buf)

    counting = dataclasses.replace(config, experts=Counting(config.experts))
    idle = np.setdiff1d(np.arange(16), used)
    poisoned = jax.tree_util.tree_map(lambda a: a.at[idle].set(jnp.nan), params["experts"])
    y = moe_apply({**params, "experts": poisoned}, x, counting, capacity_factor=0.0)[0]
    jax.effects_barrier()
    assert len(ran) == int(np.sum(-(-counts // 2))) and 0 < len(used) < 16  # chunks of 2 rows
    ref_config, _ = _layer("swiglu", GATES[0], "ragged")
    ref = moe_apply(params, x, ref_config, capacity_factor=0.0)[0]
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_crowded_routing_stays_on_the_bucketed_path_on_cpu(monkeypatch):
    """Identical tokens all pick the same experts (count S > the 4x-balanced top bucket): on CPU the ladder
    reaches S for a small [E, S, M] buffer instead of falling back to ragged_dot; same result as ragged."""
    import tutel_jax.layer._expert_paths as expert_paths

    assert dropless.extend_for_cpu((4, 8), 40, 16, 256) == (4, 8, 16, 40)
    assert dropless.extend_for_cpu((4, 8), 40, 16, dropless.CPU_FULL_BUFFER_BYTES) == (4, 8)  # too big
    x = jnp.tile(jax.random.normal(jax.random.key(4), (1, 64)), (40, 1))
    config, params = _layer("swiglu", GATES[0], "ragged")
    ref = np.asarray(moe_apply(params, x, config, capacity_factor=0.0)[0])
    config, params = _layer("swiglu", GATES[0], "bucketed")

    def no_ragged(*args):
        raise AssertionError("the ragged fallback ran")

    monkeypatch.setattr(expert_paths, "_run_ragged", no_ragged)
    got = np.asarray(moe_apply(params, x, config, capacity_factor=0.0)[0])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
