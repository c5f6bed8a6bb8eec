"""From a router gate (one with `select` or `plan`) to a RoutingPlan, its aux loss and every balance loss.

x -> (training: input jitter) -> logits -> (training: additive noise) -> router selection -> RoutingPlan
(`plan_from_choices`: Tutel's slot order and capacity rules; expert choice builds its own plan) -> losses:
  'switch'  E * sum_e f_e * P_e over all k choices (HF Mixtral / Switch load-balancing loss),
  'gshard'  Tutel's GShard loss (first choice only),
  'seq_aux' DeepSeek-V3's sequence-wise balance loss,
  'z_loss'  mean(logsumexp(logits)^2), on the logits before the additive noise.
`l_aux` = losses[gate.aux_loss] (0 for 'none') + gate.z_loss_weight * losses['z_loss'].
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ..losses import gshard_loss, router_z_loss, sequence_aux_loss, switch_load_loss
from .plan import RoutingPlan, plan_from_choices

__all__ = ["is_router_gate", "route_with_router"]


def is_router_gate(gate: Any) -> bool:
    """True for gates that select experts themselves (`select`) or build their plan (`plan`)."""
    return callable(getattr(gate, "select", None)) or callable(getattr(gate, "plan", None))


def route_with_router(
    gate: Any,
    gate_params: Any,
    x: jax.Array,
    num_experts: int,
    *,
    top_k: int,
    capacity_factor: float,
    rng: jax.Array | None = None,
    deterministic: bool = True,
    batch_prioritized_routing: bool = False,
    alignment: int = 1,
    valid: jax.Array | None = None,
    num_tokens_for_capacity: int | jax.Array | None = None,
    max_count_reduce=None,
    seq_len: int | None = None,
) -> tuple[RoutingPlan, jax.Array, dict[str, jax.Array]]:
    """Routes tokens x [S, M] with a router gate.

    Args:
      gate, gate_params: the gate and its parameters.
      x: [S, M] tokens.
      num_experts: E.
      top_k, capacity_factor: resolved per-call values (expert choice ignores top_k).
      rng: key for the training-time jitter / noise (needed when either is on and not deterministic).
      batch_prioritized_routing: place tokens by descending best probability instead of token order.
      alignment, valid, num_tokens_for_capacity, max_count_reduce: as in `plan_from_choices`.
      seq_len: tokens per sequence for the sequence-wise loss (default: all S tokens form one sequence).

    Returns:
      (plan, l_aux [] float32, losses {name: [] float32}).
    """
    num_tokens = x.shape[0]
    jitter = float(getattr(gate, "jitter", 0.0) or 0.0)
    noise = float(getattr(gate, "gate_noise", 0.0) or 0.0)
    training = not deterministic
    if training and (jitter > 0 or noise > 0):
        if rng is None:
            raise ValueError("gate_noise / jitter > 0 in training mode needs an `rng` key "
                             "(or call with deterministic=True)")
        rng_jitter, rng_noise = jax.random.split(rng)
        if jitter > 0:
            scale = jax.random.uniform(rng_jitter, x.shape, jnp.float32, 1.0 - jitter, 1.0 + jitter)
            x = x * scale.astype(x.dtype)
    logits = gate.logits(gate_params, x)
    noisy = logits
    if training and noise > 0:
        noisy = logits + (noise * jax.random.normal(rng_noise, logits.shape, jnp.float32) / num_experts
                          ).astype(logits.dtype)

    losses = {"z_loss": router_z_loss(logits, valid)}
    if callable(getattr(gate, "plan", None)):
        if capacity_factor == 0:
            raise ValueError("expert-choice routing has a fixed capacity: capacity_factor must be > 0")
        plan, _ = gate.plan(gate_params, noisy, capacity_factor, alignment=alignment, valid=valid,
                            num_tokens_for_capacity=num_tokens_for_capacity
                            if isinstance(num_tokens_for_capacity, int) else None)
    else:
        choices = gate.select(gate_params, noisy, top_k)
        priority = jnp.max(choices.probs, axis=1) if batch_prioritized_routing else None
        plan = plan_from_choices(
            choices.expert_ids, choices.weights, num_experts, capacity_factor, priority=priority,
            alignment=alignment, valid=valid, num_tokens_for_capacity=num_tokens_for_capacity,
            max_count_reduce=max_count_reduce)
        seq = num_tokens if not seq_len or num_tokens % int(seq_len) else int(seq_len)
        losses["switch"] = switch_load_loss(choices.probs, choices.expert_ids, valid)
        losses["gshard"] = gshard_loss(choices.probs, choices.expert_ids, valid).astype(jnp.float32)
        losses["seq_aux"] = sequence_aux_loss(choices.probs, choices.expert_ids, seq, valid)
    kind = getattr(gate, "aux_loss", "switch")
    l_aux = jnp.zeros((), jnp.float32) if kind == "none" else losses[kind]
    weight = float(getattr(gate, "z_loss_weight", 0.0) or 0.0)
    if weight:
        l_aux = l_aux + weight * losses["z_loss"]
    return plan, l_aux.astype(jnp.float32), losses
