"""Training through every dropless path inside shard_map: expert parallel over 8 CPU devices with the experts run
locally (r = 0, dropless), 'loop' and 'native' (whose custom VJPs must give each cotangent its primal's
varying-axes type) take the same steps as 'ragged': the same losses and parameters within float32 rounding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tutel_jax import make_config
from tutel_jax.runtime import RuntimeConfig
from tutel_jax.training import MoETrainer

from support.trainer_problem import batch, loss_fn, problem_params  # noqa: E402

STEPS = 2
CONFIG = make_config({"type": "top", "k": 2, "capacity_factor": 0.0}, 16,
                     {"type": "swiglu", "count_per_node": 1, "hidden_size_per_expert": 32})


def _train(impl: str) -> tuple[list[float], list[np.ndarray]]:
    params = jax.tree.map(jnp.copy, problem_params(CONFIG))  # the trainer donates its state
    trainer = MoETrainer(CONFIG, loss_fn, optax.adam(1e-2), params,
                         RuntimeConfig.ep(8, adaptive_r=0, dropless_impl=impl), deterministic=True)
    losses = [float(trainer.step(batch(i))["loss"]) for i in range(STEPS)]
    return losses, [np.asarray(a) for a in jax.tree.leaves(trainer.state.params)]


@pytest.fixture(scope="module")
def ragged():
    return _train("ragged")


@pytest.mark.parametrize("impl", ["loop", "native"])
def test_dropless_path_trains_like_ragged_under_expert_parallelism(impl, ragged):
    losses, params = _train(impl)
    ref_losses, ref_params = ragged
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert len(params) == len(ref_params)
    for got, want in zip(params, ref_params):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(ref_params[0], np.asarray(jax.tree.leaves(problem_params(CONFIG))[0]))  # it trained
