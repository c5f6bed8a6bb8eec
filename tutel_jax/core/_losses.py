"""Tutel's load-balancing losses, computed exactly as Tutel computes them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.stats import norm

__all__ = ["gshard_loss", "load_importance_loss", "cv_squared", "switch_load_loss", "router_z_loss",
           "sequence_aux_loss", "update_correction_bias"]


def gshard_loss(scores: jax.Array, expert_ids: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """GShard loss `E * sum_e mean_s(scores[:, e]) * frac_s(first choice == e)`.

    Args:
      scores: [S, E] routing probabilities (noisy when the gate adds noise, as in Tutel).
      expert_ids: [k, S] or [S] first-choice expert ids (only choice 0 is used).
      valid: optional [S] bool; padding tokens (False) are left out of both means.
    """
    num_tokens, num_experts = scores.shape
    # S = 0 (no token): every sum below is 0, and so is the loss; S is a Python int here, so E / 0 would raise
    num_tokens = max(num_tokens, 1)
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


def _token_weights(num_tokens: int, valid: jax.Array | None) -> jax.Array:
    """[S] float32: 1 for a real token, 0 for padding."""
    return jnp.ones((num_tokens,), jnp.float32) if valid is None else valid.astype(jnp.float32)


def switch_load_loss(probs: jax.Array, expert_ids: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """Switch / Mixtral load-balancing loss `E * sum_e f_e * P_e` (HF `load_balancing_loss_func` for one layer).

    Args:
      probs: [S, E] router probabilities over all experts (softmax; for sigmoid routers the normalised
        affinities s / sum(s)).
      expert_ids: [k, S] chosen experts; f_e = (assignments to e) / S counts every choice (k = 1: Switch).
      valid: optional [S] bool; padding tokens are left out of both means.

    Returns:
      [] float32; equals k when routing and probabilities are uniform.
    """
    num_tokens, num_experts = probs.shape
    w = _token_weights(num_tokens, valid)
    denom = jnp.maximum(jnp.sum(w), 1.0)
    onehot = jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.float32)  # [k, S, E]
    frac = jnp.sum(onehot * w[None, :, None], axis=(0, 1)) / denom  # [E]
    mean_prob = jnp.sum(probs.astype(jnp.float32) * w[:, None], axis=0) / denom  # [E]
    return num_experts * jnp.sum(frac * mean_prob)


def router_z_loss(logits: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """ST-MoE router z-loss `mean_s(logsumexp(logits[s])^2)` over real tokens; [] float32."""
    w = _token_weights(logits.shape[0], valid)
    z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.square(z) * w) / jnp.maximum(jnp.sum(w), 1.0)


def sequence_aux_loss(probs: jax.Array, expert_ids: jax.Array, seq_len: int,
                      valid: jax.Array | None = None) -> jax.Array:
    """DeepSeek-V3's sequence-wise balance loss (without its alpha), averaged over sequences.

    Per sequence of T tokens: `f_e = E / (k * T) * #{t : e chosen by t}`, `P_e = mean_t s'[t, e]`,
    loss = `sum_e f_e * P_e`; the mean over the S / T sequences is returned.

    Args:
      probs: [S, E] normalised affinities s' (each row sums to 1: sigmoid scores / their sum, or a softmax).
      expert_ids: [k, S] chosen experts.
      seq_len: T; S must be a multiple of it (tokens are batch-major: sequence b is rows b*T .. b*T+T-1).
      valid: optional [S] bool; padding tokens count in neither f nor P (T is then each sequence's real count).
    """
    num_tokens, num_experts = probs.shape
    top_k = expert_ids.shape[0]
    seq_len = int(seq_len)
    if seq_len < 1 or num_tokens % seq_len:
        raise ValueError(f"seq_len must divide the token count {num_tokens}, got {seq_len}")
    num_seq = num_tokens // seq_len
    if num_seq == 0:  # S = 0: no sequence to balance (the mean over zero sequences would be NaN)
        return jnp.zeros((), jnp.float32)
    w = _token_weights(num_tokens, valid).reshape(num_seq, seq_len)
    count = jnp.maximum(jnp.sum(w, axis=1, keepdims=True), 1.0)  # [B, 1] real tokens per sequence
    onehot = jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.float32).sum(0)  # [S, E]
    chosen = jnp.sum(onehot.reshape(num_seq, seq_len, num_experts) * w[..., None], axis=1)  # [B, E]
    frac = chosen * num_experts / (top_k * count)
    mean_prob = jnp.sum(probs.astype(jnp.float32).reshape(num_seq, seq_len, num_experts) * w[..., None], axis=1) / count
    return jnp.mean(jnp.sum(frac * mean_prob, axis=1))


def update_correction_bias(bias: jax.Array, dispatch_count: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free balancing (DeepSeek-V3): `bias + rate * sign(mean_load - load_e)`.

    Called outside the optimizer after each step with the step's (global) `dispatch_count` [E]: overloaded experts
    get a lower selection bias, underloaded ones a higher one. The bias only affects which experts are selected,
    never the combine weights, and receives no gradient.
    """
    load = dispatch_count.astype(jnp.float32)
    step = rate * jnp.sign(jnp.mean(load) - load)
    return (bias.astype(jnp.float32) + step).astype(bias.dtype)
