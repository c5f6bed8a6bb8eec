"""Tutel's load-balancing losses, computed exactly as Tutel computes them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.stats import norm

__all__ = ["gshard_loss", "load_importance_loss", "cv_squared"]


def gshard_loss(scores: jax.Array, expert_ids: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """GShard loss `E * sum_e mean_s(scores[:, e]) * frac_s(first choice == e)`.

    Args:
      scores: [S, E] routing probabilities (noisy when the gate adds noise, as in Tutel).
      expert_ids: [k, S] or [S] first-choice expert ids (only choice 0 is used).
      valid: optional [S] bool; padding tokens (False) are left out of both means.
    """
    num_tokens, num_experts = scores.shape
    first = expert_ids[0] if expert_ids.ndim == 2 else expert_ids
    mask = jax.nn.one_hot(first, num_experts, dtype=scores.dtype)
    if valid is not None:
        num_tokens = jnp.maximum(jnp.sum(valid.astype(scores.dtype)), 1)
        mask = mask * valid[:, None].astype(scores.dtype)
        scores = jnp.where(valid[:, None], scores, 0)
    # same operation order as Tutel: one-hot rows worth E / S, summed, dotted with the summed scores, / S
    ce = jnp.sum(mask * (num_experts / num_tokens), axis=0)
    me = jnp.sum(scores, axis=0)
    return jnp.sum(me * ce) / num_tokens


def cv_squared(v: jax.Array) -> jax.Array:
    """Tutel's squared coefficient of variation: var (ddof=1) / (mean^2 + 1e-10)."""
    v = v.astype(jnp.float32)
    return jnp.var(v, ddof=1) / (jnp.mean(v) ** 2 + 1e-10)


def load_importance_loss(scores: jax.Array, top_k_logits: jax.Array, num_experts: int, gate_noise: float,
                         valid: jax.Array | None = None) -> jax.Array:
    """Importance + load loss (Shazeer et al.), with Tutel's quirk kept.

    Args:
      scores: [S, E] softmax of the noise-free logits.
      top_k_logits: [S, k] noisy logits at the chosen experts, in choice order; the last column is the threshold.
        Tutel compares this LOGIT threshold against the probabilities `scores` -- reproduced on purpose.
      num_experts: E.
      gate_noise: the gate's noise scale (> 0): the normal CDF has standard deviation gate_noise / E.
      valid: optional [S] bool; padding tokens (False) are left out of the sums.
    """
    if not gate_noise > 0:
        raise ValueError(f"gate_noise must be > 0 for the importance+load loss (is_gshard_loss=False), got {gate_noise}")
    keep = 1.0 if valid is None else valid[:, None].astype(jnp.float32)
    importance = cv_squared(jnp.sum(scores.astype(jnp.float32) * keep, axis=0))
    threshold = top_k_logits[:, -1:].astype(jnp.float32)
    prob = norm.cdf(scores.astype(jnp.float32) - threshold, loc=0.0, scale=gate_noise / num_experts)
    load = cv_squared(jnp.sum(prob * keep, axis=0))
    return (importance + load) / 2.0
