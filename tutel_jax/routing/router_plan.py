"""From a router gate (one with `select` or `plan`) to a RoutingPlan, its aux loss and every balance loss.

x -> (training: input jitter) -> logits -> (training: additive noise) -> router selection -> RoutingPlan
(`plan_from_choices`: Tutel's slot order and capacity rules; expert choice builds its own plan) -> losses:
  'switch'  E * sum_e f_e * P_e over all k choices (HF Mixtral / Switch load-balancing loss),
  'gshard'  Tutel's GShard loss (first choice only),
  'seq_aux' DeepSeek-V3's sequence-wise balance loss,
  'z_loss'  mean(logsumexp(logits)^2), on the logits before the additive noise.
`l_aux` = losses[gate.aux_loss] (0 for 'none') + gate.z_loss_weight * losses['z_loss'].

With a `kernel_backend` and no padding mask, a gate whose `kernel_gating` describes it has its experts and slots
chosen by the fused gating kernel (`pallas_kernels.gating`, integer outputs only); the weights and probs are
recomputed from the logits by the gate (`choices_for_ids`), so plan, gradients and losses equal the plain path's.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ..losses import gshard_loss, router_z_loss, sequence_aux_loss, switch_load_loss
from .plan import RoutingPlan, plan_from_choices
from .routers import RouterChoices

__all__ = ["is_router_gate", "route_with_router", "zero_losses"]


def is_router_gate(gate: Any) -> bool:
    """True for gates that select experts themselves (`select`) or build their plan (`plan`)."""
    return callable(getattr(gate, "select", None)) or callable(getattr(gate, "plan", None))


def zero_losses(gate: Any) -> dict[str, jax.Array]:
    """The `losses` dict `route_with_router` returns for `gate`, every entry 0 (a batch without tokens):
    {} for Tutel's gates, {'z_loss'} for expert choice, and the four losses of the top-k routers."""
    if not is_router_gate(gate):
        return {}
    names = ("z_loss",) if callable(getattr(gate, "plan", None)) else ("z_loss", "switch", "gshard", "seq_aux")
    return {name: jnp.zeros((), jnp.float32) for name in names}


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
    kernel_backend: str | None = None,
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
      kernel_backend: a `pallas_kernels` implementation for the fused gating kernel (used without `valid` and
        when the gate's `kernel_gating` allows it), or None for plain XLA.

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
    if callable(getattr(gate, "plan", None)):  # capacity_factor > 0: checked by `expert_choice_capacity`
        plan, _ = gate.plan(gate_params, noisy, capacity_factor, alignment=alignment, valid=valid,
                            num_tokens_for_capacity=num_tokens_for_capacity
                            if isinstance(num_tokens_for_capacity, int) else None)
    else:
        spec = _kernel_spec(gate, gate_params, top_k, num_experts, kernel_backend, valid)
        if spec is None:
            choices = gate.select(gate_params, noisy, top_k)
            priority = jnp.max(choices.probs, axis=1) if batch_prioritized_routing else None
            plan = plan_from_choices(
                choices.expert_ids, choices.weights, num_experts, capacity_factor, priority=priority,
                alignment=alignment, valid=valid, num_tokens_for_capacity=num_tokens_for_capacity,
                max_count_reduce=max_count_reduce)
        else:
            choices, slots = _kernel_choices(gate, gate_params, noisy, top_k, num_experts, spec,
                                             batch_prioritized_routing, kernel_backend)
            plan = plan_from_choices(
                choices.expert_ids, choices.weights, num_experts, capacity_factor, alignment=alignment,
                num_tokens_for_capacity=num_tokens_for_capacity, max_count_reduce=max_count_reduce, slots=slots)
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


def _kernel_spec(gate: Any, gate_params: Any, top_k: int, num_experts: int, kernel_backend: str | None,
                 valid: jax.Array | None) -> dict | None:
    """The gate's `pallas_kernels.gating` arguments, or None for the plain path (no backend, a padding mask,
    or a gate the kernel cannot reproduce exactly)."""
    describe = getattr(gate, "kernel_gating", None)
    if kernel_backend is None or valid is not None or not callable(describe):
        return None
    return describe(gate_params, top_k, num_experts)


def _kernel_choices(
    gate: Any,
    gate_params: Any,
    logits: jax.Array,
    top_k: int,
    num_experts: int,
    spec: dict,
    batch_prioritized_routing: bool,
    kernel_backend: str,
) -> tuple[RouterChoices, tuple[jax.Array, jax.Array]]:
    """The gate's choices with experts and slots from the fused gating kernel.

    Args:
      logits: [S, E] (noisy) router logits.
      spec: the gate's `kernel_gating` arguments.

    Returns:
      (choices: expert_ids [k, S] from the kernel, weights [k, S] and probs [S, E] recomputed differentiably
      by the gate; slots: (locations [k, S], counts [E]) in Tutel's order, for `plan_from_choices`).
    """
    import pallas_kernels
    fused = pallas_kernels.gating(jax.lax.stop_gradient(logits), top_k, **spec, implementation=kernel_backend)
    ids, locations, counts = jax.lax.stop_gradient((fused.expert_ids, fused.locations, fused.counts))
    choices = gate.choices_for_ids(gate_params, logits, ids)
    if batch_prioritized_routing:
        # the kernel's own order is max(scores), not max(probs) for sigmoid routers (probs = scores / sum):
        # re-rank in the plain path's order, which is exact for every router
        order = jnp.argsort(-jax.lax.stop_gradient(jnp.max(choices.probs, axis=1)), stable=True)
        locations, counts = pallas_kernels.slot_positions(ids, num_experts, order, implementation=kernel_backend)
    return choices, (locations, counts)
