"""The routing pipeline: from any gate and tokens to a RoutingPlan, the aux loss and every balance loss.

Every gate goes through `route_tokens`:

  x -> (training: input jitter) -> logits -> (training: additive noise) -> the gate's selection -> RoutingPlan
    -> losses

The selection depends on the gate (`Gate.selection`):
  'tutel'   Tutel's `top` / `cosine_top` (and custom gates without `select`): scores = softmax(noisy logits) in
            the logits' dtype, `top_k_routing` (top-k, weights renormalised per `normalize_gate`, Tutel's slots,
            capacity and batch-prioritized order);
  'select'  routers (Qwen3-MoE, Mixtral, DeepSeek-V3, GPT-OSS, Switch, ...): `gate.select`, then
            `plan_from_choices` (the same slots and capacity rules);
  'plan'    expert choice: `gate.plan` builds the plan.
With a `kernel_backend` and no padding mask, the fused gating kernel (`pallas_kernels.gating`) chooses the
experts and slots of Tutel's gates and of the routers it reproduces exactly (`Gate.kernel_gating`); the weights
are recomputed differentiably (`kernel_choices`), so plans, gradients and losses equal the plain path's.

Losses (`routing_losses`):
  Tutel's gates: l_aux = Tutel's GShard loss (`is_gshard_loss`) or its importance + load loss; `losses` is {}.
  Routers: `losses` holds 'z_loss' (mean(logsumexp(logits)^2), on the logits before the noise) and, for `select`
    routers, 'switch' (E * sum_e f_e * P_e over all k choices), 'gshard' (first choice only) and 'seq_aux'
    (DeepSeek-V3's sequence-wise loss); l_aux = losses[gate.aux_loss] (0 for 'none') + z_loss_weight * z_loss.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels.gating import normalize_weights

from .. import core
from ..core import gshard_loss, load_importance_loss, router_z_loss, sequence_aux_loss, switch_load_loss
from ._gates import PLAN, SELECT, TUTEL, Gate, as_gate
from ._plan import RoutingPlan, plan_from_choices, top_k_routing
from ._routers import RouterChoices

__all__ = ["route_tokens", "gate_logits", "logit_noise", "kernel_choices", "routing_losses", "loss_names",
           "zero_losses"]


def route_tokens(
    gate: Any,
    gate_params: Any,
    x: jax.Array,
    num_experts: int,
    *,
    top_k: int,
    capacity_factor: float,
    rng: jax.Array | None = None,
    deterministic: bool = True,
    normalize_gate: bool = True,
    is_gshard_loss: bool = True,
    batch_prioritized_routing: bool = False,
    alignment: int = 1,
    valid: jax.Array | None = None,
    num_tokens_for_capacity: int | jax.Array | None = None,
    max_count_reduce=None,
    seq_len: int | None = None,
    kernel_backend: str | None = None,
) -> tuple[RoutingPlan, jax.Array, dict[str, jax.Array]]:
    """Routes tokens x [S, M] with any gate.

    Args:
      gate, gate_params: the gate (a `Gate`, or an object `as_gate` wraps) and its parameters.
      x: [S, M] tokens.
      num_experts: E.
      top_k, capacity_factor: resolved per-call values (expert choice ignores top_k; Tutel's gates clip k to E).
      rng: key for the training-time jitter / noise (needed when either is on and not deterministic).
      deterministic: no jitter and no noise (eval mode).
      normalize_gate: Tutel's gates: renormalise the k > 1 weights of each token (by max(sum, eps)).
      is_gshard_loss: Tutel's gates: GShard loss (True) or importance + load loss (False).
      batch_prioritized_routing: place tokens by descending best probability instead of token order.
      alignment, valid, num_tokens_for_capacity, max_count_reduce: as in `plan_from_choices`.
      seq_len: tokens per sequence for the sequence-wise loss (default: all S tokens form one sequence).
      kernel_backend: a `pallas_kernels` implementation for the fused gating kernel (used without `valid`, for
        Tutel's gates and the routers whose `kernel_gating` allows it), or None for plain XLA.

    Returns:
      (plan, l_aux [], losses {name: [] float32}). l_aux is float32 for routers and in the scores' dtype for
      Tutel's gates (as Tutel computes it).
    """
    gate = as_gate(gate)
    kind = gate.selection
    logits, noisy = gate_logits(gate, gate_params, x, num_experts, rng=rng, training=not deterministic)
    z_loss = None if kind == TUTEL else router_z_loss(logits, valid)  # on the noise-free logits

    scores = choices = None
    if kind == PLAN:  # capacity_factor > 0: checked by `expert_choice_capacity`
        plan, _ = gate.plan(gate_params, noisy, capacity_factor, alignment=alignment, valid=valid,
                            num_tokens_for_capacity=num_tokens_for_capacity
                            if isinstance(num_tokens_for_capacity, int) else None)
    else:
        if kind == TUTEL:
            scores = jax.nn.softmax(noisy, axis=1)
        kernel_backend = core.kernels(kernel_backend)  # the compile platform's kernels unless set
        spec = _kernel_spec(gate, gate_params, top_k, num_experts, normalize_gate=normalize_gate,
                            batch_prioritized_routing=batch_prioritized_routing, kernel_backend=kernel_backend,
                            valid=valid)
        if spec is not None:
            if kind == TUTEL:
                def choices_for_ids(ids):
                    return _tutel_choices(scores, ids, normalize_gate)
            else:
                def choices_for_ids(ids):
                    return gate.choices_for_ids(gate_params, noisy, ids)
            choices, slots = kernel_choices(noisy, top_k, num_experts, spec, choices_for_ids,
                                            batch_prioritized_routing=batch_prioritized_routing,
                                            kernel_backend=kernel_backend)
            plan = plan_from_choices(
                choices.expert_ids, choices.weights, num_experts, capacity_factor, alignment=alignment,
                num_tokens_for_capacity=num_tokens_for_capacity, max_count_reduce=max_count_reduce, slots=slots)
        elif kind == TUTEL:
            plan = top_k_routing(
                scores, top_k, capacity_factor, batch_prioritized_routing=batch_prioritized_routing,
                normalize_gate=normalize_gate, alignment=alignment, valid=valid,
                num_tokens_for_capacity=num_tokens_for_capacity, max_count_reduce=max_count_reduce)
        else:
            choices = gate.select(gate_params, noisy, top_k)
            priority = jnp.max(choices.probs, axis=1) if batch_prioritized_routing else None
            plan = plan_from_choices(
                choices.expert_ids, choices.weights, num_experts, capacity_factor, priority=priority,
                alignment=alignment, valid=valid, num_tokens_for_capacity=num_tokens_for_capacity,
                max_count_reduce=max_count_reduce)
    l_aux, losses = routing_losses(gate, plan, logits=logits, noisy=noisy, scores=scores, choices=choices,
                                   z_loss=z_loss, num_experts=num_experts, is_gshard_loss=is_gshard_loss,
                                   valid=valid, seq_len=seq_len)
    return plan, l_aux, losses


def gate_logits(gate: Gate, gate_params: Any, x: jax.Array, num_experts: int, *, rng: jax.Array | None,
                training: bool) -> tuple[jax.Array, jax.Array]:
    """(logits, noisy logits) [S, E] of tokens x [S, M]: the training-time input jitter and additive noise.

    Keys: routers split `rng` into (jitter, noise) keys; Tutel's gates draw the noise from `rng` itself, as
    Tutel's layer always has (and split it like the routers only when they have a jitter).
    """
    jitter = float(gate.jitter or 0.0)
    noise = float(gate.gate_noise or 0.0)
    tutel = gate.selection == TUTEL
    rng_noise = rng
    if training and gate.needs_rng:  # jitter > 0 or noise > 0
        if rng is None:
            raise ValueError("gate_noise / jitter > 0 in training mode needs an `rng` key "
                             "(or call with deterministic=True)")
        if jitter > 0 or not tutel:
            rng_jitter, rng_noise = jax.random.split(rng)
        if jitter > 0:
            scale = jax.random.uniform(rng_jitter, x.shape, jnp.float32, 1.0 - jitter, 1.0 + jitter)
            x = x * scale.astype(x.dtype)
    logits = gate.logits(gate_params, x)
    noisy = logits
    if training and noise > 0:
        noisy = logit_noise(logits, rng_noise, noise, num_experts, in_logits_dtype=tutel)
    return logits, noisy


def logit_noise(logits: jax.Array, key: jax.Array, gate_noise: float, num_experts: int, *,
                in_logits_dtype: bool = False) -> jax.Array:
    """`logits + gate_noise * N(0, 1) / E`, the normal drawn in float32 from `key`.

    in_logits_dtype: Tutel's gates: the normal is cast to the logits' dtype and scaled there (Tutel's
    `logits + gate_noise * randn_like(logits) / E`); otherwise (routers) it is scaled in float32, then cast.
    Both are the same for float32 logits.
    """
    normal = jax.random.normal(key, logits.shape, jnp.float32)
    if in_logits_dtype:
        return logits + gate_noise * normal.astype(logits.dtype) / num_experts
    return logits + (gate_noise * normal / num_experts).astype(logits.dtype)


def _kernel_spec(gate: Gate, gate_params: Any, top_k: int, num_experts: int, *, normalize_gate: bool,
                 batch_prioritized_routing: bool, kernel_backend: str | None, valid: jax.Array | None
                 ) -> dict | None:
    """The `pallas_kernels.gating` arguments that reproduce the gate's choices, or None for the plain path (no
    backend, a padding mask, expert choice, or a router the kernel cannot reproduce exactly)."""
    if kernel_backend is None or valid is not None or gate.selection == PLAN:
        return None
    if gate.selection == TUTEL:  # the kernel's priority (max softmax score) is Tutel's exactly: it places tokens
        return {"score_fn": "softmax", "normalize": normalize_gate,
                "batch_prioritized_routing": batch_prioritized_routing}
    return gate.kernel_gating(gate_params, top_k, num_experts)


def _tutel_choices(scores: jax.Array, expert_ids: jax.Array, normalize_gate: bool) -> RouterChoices:
    """Tutel's top-k weights [k, S] for the given experts ids [k, S]: the scores [S, E] there, divided by
    max(sum, eps) for k > 1 with `normalize_gate` (as `top_k_routing`); probs are the scores."""
    gates = jnp.take_along_axis(scores, expert_ids.T, axis=1).T  # [k, S]
    return RouterChoices(expert_ids, normalize_weights(gates, "softmax", normalize_gate), scores)


def kernel_choices(
    logits: jax.Array,
    top_k: int,
    num_experts: int,
    spec: dict,
    choices_for_ids: Callable[[jax.Array], RouterChoices],
    *,
    batch_prioritized_routing: bool,
    kernel_backend: str,
) -> tuple[RouterChoices, tuple[jax.Array, jax.Array]]:
    """A gate's choices with experts and slots from the fused gating kernel.

    Args:
      logits: [S, E] (noisy) logits.
      spec: the `pallas_kernels.gating` keyword arguments (a router's `kernel_gating`; for Tutel's gates they
        include `batch_prioritized_routing`: the kernel's own priority, the max softmax score, is Tutel's).
      choices_for_ids: expert ids [k, S] -> RouterChoices with weights [k, S] and probs [S, E] recomputed
        differentiably from the logits.
      batch_prioritized_routing: when `spec` leaves it out, the kernel's slots are re-ranked by the best
        probability (the plain path's order; the kernel's is max(scores), not max(probs) for sigmoid routers).

    Returns:
      (choices: expert_ids [k, S] from the kernel, weights and probs from `choices_for_ids`; slots:
      (locations [k, S], counts [E]) in Tutel's order, for `plan_from_choices`).
    """
    fused = pallas_kernels.gating(jax.lax.stop_gradient(logits), top_k, **spec, implementation=kernel_backend)
    ids, locations, counts = jax.lax.stop_gradient((fused.expert_ids, fused.locations, fused.counts))
    choices = choices_for_ids(ids)
    if batch_prioritized_routing and "batch_prioritized_routing" not in spec:
        order = jnp.argsort(-jax.lax.stop_gradient(jnp.max(choices.probs, axis=1)), stable=True)
        locations, counts = pallas_kernels.slot_positions(ids, num_experts, order, implementation=kernel_backend)
    return choices, (locations, counts)


def routing_losses(
    gate: Gate,
    plan: RoutingPlan,
    *,
    logits: jax.Array,
    noisy: jax.Array,
    scores: jax.Array | None,
    choices: RouterChoices | None,
    z_loss: jax.Array | None,
    num_experts: int,
    is_gshard_loss: bool,
    valid: jax.Array | None = None,
    seq_len: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(l_aux, losses) of one routing (see the module docstring).

    Args:
      logits, noisy: [S, E] logits before and after the noise.
      scores: [S, E] Tutel's gates' softmax of the noisy logits (else None).
      choices: a `select` router's choices (else None).
      z_loss: routers' z-loss of `logits` (else None).
      seq_len: tokens per sequence for 'seq_aux' (default, or when it does not divide S: one sequence).
    """
    kind = gate.selection
    if kind == TUTEL:
        if is_gshard_loss:
            return gshard_loss(scores, plan.expert_ids, valid), {}
        top_logits = jnp.take_along_axis(noisy, plan.expert_ids.T, axis=1)
        return load_importance_loss(jax.nn.softmax(logits, axis=1), top_logits, num_experts, gate.gate_noise,
                                    valid), {}
    losses = {"z_loss": z_loss}
    if kind == SELECT:
        num_tokens = logits.shape[0]
        seq = num_tokens if not seq_len or num_tokens % int(seq_len) else int(seq_len)
        losses["switch"] = switch_load_loss(choices.probs, choices.expert_ids, valid)
        losses["gshard"] = gshard_loss(choices.probs, choices.expert_ids, valid).astype(jnp.float32)
        losses["seq_aux"] = sequence_aux_loss(choices.probs, choices.expert_ids, seq, valid)
    name = gate.aux_loss or ("switch" if kind == SELECT else "none")
    l_aux = jnp.zeros((), jnp.float32) if name == "none" else losses[name]
    weight = float(gate.z_loss_weight or 0.0)
    if weight:
        l_aux = l_aux + weight * losses["z_loss"]
    return l_aux.astype(jnp.float32), losses


def loss_names(gate: Any) -> tuple[str, ...]:
    """The keys of the `losses` dict `route_tokens` returns for `gate`: () for Tutel's gates, ('z_loss',) for
    expert choice, and the four losses of the `select` routers."""
    kind = as_gate(gate).selection
    if kind == TUTEL:
        return ()
    return ("z_loss",) if kind == PLAN else ("z_loss", "switch", "gshard", "seq_aux")


def zero_losses(gate: Any) -> dict[str, jax.Array]:
    """The `losses` dict `route_tokens` returns for `gate`, every entry 0 (a batch without tokens)."""
    return {name: jnp.zeros((), jnp.float32) for name in loss_names(gate)}
