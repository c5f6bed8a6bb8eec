"""`MoETrainer.evaluate` on 8 fake CPU devices: the loss without gradients, updates or gate noise.

Model: x @ proj -> MoE (top-2 gate, cf 1.0, E = 4 relu ffn experts) -> mean squared error to tanh(x)
+ 0.01 l_aux. The oracle is a float64 NumPy forward pass (tests/support/reference_np.py) in which every one of the 8
token shards (2 samples x 8 tokens) is routed on its own, as every device routes its own tokens; l_aux is the
mean over the shards. Float32 against float64: rtol 1e-5.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from support import reference_np as ref
from tutel_jax import make_config
from tutel_jax.runtime import RuntimeConfig
from tutel_jax.training import MoETrainer
from support.trainer_problem import M, batch, loss_fn, problem_params as _params

H, E, K = 16, 4, 2
SHARDS = 8
A = RuntimeConfig.ep(8)                    # 8 devices share 4 experts (s = 2, r = 1)
B = RuntimeConfig.ep(4, data=2)            # one expert per device, 2 replicas: the same math (layout only)


def _config(gate_noise: float):
    return make_config({"type": "top", "k": K, "capacity_factor": 1.0, "gate_noise": gate_noise}, M,
                       {"type": "ffn", "count_per_node": E, "hidden_size_per_expert": H, "activation_fn": jax.nn.relu})




def trainer(*, gate_noise: float = 0.0, deterministic: bool = True) -> MoETrainer:
    config = _config(gate_noise)
    return MoETrainer(config, loss_fn, optax.adam(1e-2), _params(config), A, seed=7, deterministic=deterministic)


def reference(params, b) -> tuple[float, float]:
    """(loss, dropped fraction) in float64, each token shard routed on its own."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x, t = np.asarray(b["x"], np.float64), np.asarray(b["t"], np.float64)
    h = x @ p["proj"]
    layer_params = {"wg": p["moe"]["gates"][0]["wg"]["weight"], **p["moe"]["experts"]}
    ys, losses, dropped, total = [], [], 0, 0
    for shard in np.split(h, SHARDS, axis=0):  # device d holds samples [2d, 2d + 2)
        tokens = shard.reshape(-1, M)
        y, l_aux, (_, loc, _, _, cap) = ref.layer(tokens, layer_params, K, 1.0)
        ys.append(y.reshape(shard.shape))
        losses.append(l_aux)
        dropped, total = dropped + int(np.sum(loc >= cap)), total + loc.size
    y = np.concatenate(ys, axis=0)
    return float(np.mean((y - t) ** 2) + 0.01 * np.mean(losses)), dropped / total


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def test_evaluate_matches_the_reference_and_the_loss_step_computes_and_changes_nothing():
    tr = trainer()
    b = batch(0)
    params = _host(tr.state.params)
    before = _host(tr.state)
    want_loss, want_dropped = reference(params, b)
    got = tr.evaluate(b)
    np.testing.assert_allclose(float(got["loss"]), want_loss, rtol=1e-5)
    np.testing.assert_allclose(float(got["dropped"]), want_dropped, rtol=0, atol=1e-7)
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(_host(tr.state))):  # state untouched, bit for bit
        np.testing.assert_array_equal(x, y)
    assert int(tr.state.step) == 0
    step_metrics = tr.step(b)  # the loss of the state before its update
    np.testing.assert_allclose(float(got["loss"]), float(step_metrics["loss"]), rtol=1e-6)
    assert float(got["dropped"]) == float(step_metrics["dropped"])
    after = tr.evaluate(b)  # the updated params: a new loss, still the reference's
    np.testing.assert_allclose(float(after["loss"]), reference(_host(tr.state.params), b)[0], rtol=1e-5)
    assert abs(float(after["loss"]) - float(got["loss"])) > 1e-4  # the step did change the params


def test_evaluate_has_no_gate_noise_even_when_training_has():
    noisy = trainer(gate_noise=1.0, deterministic=False)
    b = batch(1)
    want = reference(_host(noisy.state.params), b)[0]
    np.testing.assert_allclose(float(noisy.evaluate(b)["loss"]), want, rtol=1e-5)
    noisy_step_loss = float(noisy.step(b)["loss"])  # same params, gate noise on: another routing
    assert abs(noisy_step_loss - want) > 1e-4 * abs(want)


def test_evaluate_is_compiled_once_per_config_in_its_own_cache():
    tr = trainer()
    b0, b1 = batch(2), batch(3)
    tr.step(b0)
    step_info = tr.cache_info()
    first = float(tr.evaluate(b0)["loss"])
    tr.evaluate(b1)
    info = tr.eval_cache_info()
    assert (info.compiles, info.hits, info.traces, info.entries, info.configs) == (1, 1, 1, 1, (tr.runtime,))
    tr.switch(B)
    on_b = float(tr.evaluate(b0)["loss"])
    np.testing.assert_allclose(on_b, first, rtol=1e-6)  # layout-only switch: the same loss
    tr.switch(A)
    np.testing.assert_allclose(float(tr.evaluate(b0)["loss"]), first, rtol=1e-6)
    info = tr.eval_cache_info()
    assert (info.compiles, info.hits, info.traces, info.entries) == (2, 2, 2, 2)
    assert tr.cache_info() == step_info  # evaluate left the step cache's statistics alone


def test_evaluate_refuses_a_batch_the_token_shards_cannot_split():
    tr = trainer()
    x = jnp.zeros((12, 8, M))
    with pytest.raises(ValueError, match=r"divisible by the 8 token shards, got shape \(12, 8, 16\)"):
        tr.evaluate({"x": x, "t": x})
    assert tr.eval_cache_info().compiles == 0
