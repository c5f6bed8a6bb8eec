"""The small MoE training problem the trainer tests share: x [16, 8, M] @ proj -> MoE layer -> mean squared
error to tanh(x) + 0.01 l_aux (metrics: the layer's dropped fraction)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tutel_jax import init_params

M = 16  # model dim


def problem_params(config):
    """{'proj': [M, M], 'moe': the layer's params} for an MoEConfig of model_dim M."""
    return {"proj": jax.random.normal(jax.random.key(3), (M, M)) / 4, "moe": init_params(config, jax.random.key(0))}


def loss_fn(params, batch, moe):
    y, aux = moe(params["moe"], batch["x"] @ params["proj"])
    return jnp.mean((y - batch["t"]) ** 2) + 0.01 * aux.l_aux, {"dropped": aux.dropped_fraction}


def batch(i: int) -> dict:
    """Batch i: x [16, 8, M] normal (key 100 + i), target tanh(x)."""
    x = jax.random.normal(jax.random.key(100 + i), (16, 8, M))
    return {"x": x, "t": jnp.tanh(x)}
