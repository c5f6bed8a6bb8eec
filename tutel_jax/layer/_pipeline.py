"""The MoE layer as pure functions: `init_params` and `moe_apply`.

Data flows one way: x -> gate logits -> (noise) -> softmax scores -> routing plan -> encode -> experts ->
decode -> y, plus the aux loss from the scores. `moe_apply` works under `jax.jit` and `jax.grad` with the config
and per-call switches static.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from ..core import CallOptions, LOCAL, TokenGroup
from ._config import MoEConfig
from ._expert_paths import run_experts_buffered, run_experts_dropless, run_routed_experts
from ..routing import RoutingPlan, PLAN, Gate, as_gate, route_tokens, zero_losses
from ..validation import check_capacity_factor, check_input, check_int

__all__ = ["MoEAux", "init_params", "moe_apply", "moe_pipeline", "run_routed_experts", "run_experts_buffered",
           "run_experts_dropless", "route", "apply_shared_experts", "routing_args", "empty_result"]


@dataclasses.dataclass(frozen=True)
class MoEAux:
    """What one call of the layer reports besides its output.

    Attributes:
      l_aux: [] float32 load-balancing loss.
      dispatch_count: [E] int32 assignments per expert before dropping.
      capacity: [] int32 Tutel's capacity C.
      dropped_fraction: [] float32 fraction of the k*S assignments dropped.
      losses: {name: [] float32} every balance loss a router gate computes ('switch', 'gshard', 'seq_aux',
        'z_loss'; see `routing.route_tokens`), unweighted; empty for Tutel's gates.
    """

    l_aux: jax.Array
    dispatch_count: jax.Array
    capacity: jax.Array
    dropped_fraction: jax.Array
    losses: dict = dataclasses.field(default_factory=dict)


jax.tree_util.register_dataclass(
    MoEAux, data_fields=["l_aux", "dispatch_count", "capacity", "dropped_fraction", "losses"], meta_fields=[])


def init_params(config: MoEConfig, key: jax.Array | None = None, *, seeds: tuple | None = None) -> dict:
    """Fresh global parameters `{'gates': [gate params, ...], 'experts': expert params}` for all E experts.

    Either `key` (a PRNG key) or Tutel's `seeds` = (gate seed, expert seed, ...): gate i uses seed[0] + i,
    the experts seed[1].
    """
    num_gates = len(config.gates)
    if seeds is not None:
        gate_keys = [jax.random.key(int(seeds[0]) + i) for i in range(num_gates)]
        expert_key = jax.random.key(int(seeds[1]))
    else:
        if key is None:
            raise ValueError("init_params needs a PRNG `key` or Tutel `seeds`")
        keys = jax.random.split(key, num_gates + 1)
        gate_keys, expert_key = list(keys[:num_gates]), keys[num_gates]
    params = {
        "gates": [g.init(k, config.model_dim, config.num_global_experts, config.dtype)
                  for g, k in zip(config.gates, gate_keys)],
        "experts": config.experts.init(expert_key, config.model_dim, config.num_global_experts, config.dtype),
    }
    if config.shared_experts is not None:
        params["shared_experts"] = config.shared_experts.init(
            jax.random.fold_in(expert_key, 1), config.model_dim, config.output_dim, config.dtype)
    return params


def apply_shared_experts(params: dict, tokens: jax.Array, y: jax.Array, config: MoEConfig) -> jax.Array:
    """y [S, M_out] plus the shared experts' output on tokens [S, M] (y unchanged without shared experts)."""
    if config.shared_experts is None:
        return y
    if "shared_experts" not in params:
        raise ValueError("the config has shared experts but params has no 'shared_experts' entry")
    shared = config.shared_experts.apply(params["shared_experts"], tokens.astype(config.dtype))
    return y + shared.astype(y.dtype)


def route(
    gate_params: Any,
    x: jax.Array,
    config: MoEConfig,
    *,
    top_k: int | None = None,
    capacity_factor: float | None = None,
    gate_index: int = 0,
    rng: jax.Array | None = None,
    deterministic: bool = True,
    alignment: int = 1,
    valid: jax.Array | None = None,
    num_tokens_for_capacity: int | jax.Array | None = None,
    max_count_reduce=None,
    seq_len: int | None = None,
    return_losses: bool = False,
):
    """Gate + routing for tokens x [S, M] -> (RoutingPlan, l_aux); `valid` [S] masks padding tokens out.

    One call of `routing.pipeline.route_tokens` with the config's options, for every gate: Tutel's (softmax
    top-k, `normalize_gate`, GShard or importance + load loss per `is_gshard_loss`), the routers (`select`:
    Mixtral, Qwen3-MoE, DeepSeek-V3, GPT-OSS, ...) and expert choice (`plan`). With `config.kernel_backend` and
    no `valid`, the fused gating kernel chooses experts and slots for Tutel's gates and for the routers it
    reproduces exactly (see `Gate.kernel_gating`). `seq_len` (tokens per sequence) is used by the sequence-wise
    loss. With `return_losses` the result is (plan, l_aux, losses).
    """
    gate, k, cf = routing_args(config, gate_index, top_k, capacity_factor)
    plan, l_aux, losses = route_tokens(
        gate, gate_params, x, config.num_global_experts, top_k=k, capacity_factor=cf, rng=rng,
        deterministic=deterministic, normalize_gate=config.normalize_gate, is_gshard_loss=config.is_gshard_loss,
        batch_prioritized_routing=config.batch_prioritized_routing, alignment=alignment, valid=valid,
        num_tokens_for_capacity=num_tokens_for_capacity, max_count_reduce=max_count_reduce, seq_len=seq_len,
        kernel_backend=config.kernel_backend)
    return (plan, l_aux, losses) if return_losses else (plan, l_aux)


def routing_args(config: MoEConfig, gate_index: int = 0, top_k: int | None = None,
                 capacity_factor: float | None = None) -> tuple[Gate, int, float]:
    """(gate, k, cf) of one call: the per-call overrides, or the gate's defaults, checked.

    Raises ValueError for a bad gate_index, a k that is not an integer >= 1, a capacity factor that is not a
    finite number (`validation.check_capacity_factor`), and cf <= 0 for expert-choice routing (its capacity is
    fixed). Every call checks them, whatever the batch, even one without tokens (`moe_apply` skips routing).
    """
    gate = as_gate(config.gate(gate_index))  # a Gate already when the config comes from `make_config`
    k = gate.k if top_k is None else top_k
    check_int(k, "top_k", minimum=1)
    cf = check_capacity_factor(gate.capacity_factor if capacity_factor is None else capacity_factor)
    if gate.selection == PLAN and not cf > 0:
        raise ValueError(f"expert-choice routing has a fixed capacity: capacity_factor must be > 0, got {cf}")
    return gate, k, cf


def empty_result(x: jax.Array, config: MoEConfig, gate: Gate) -> tuple[jax.Array, MoEAux]:
    """The layer's result for an input x [..., M] holding no token (a zero-size leading axis).

    y: zeros [..., M_out] in x's dtype (then `config.result_func`); aux: l_aux and every loss `gate` reports 0,
    no assignment (dispatch_count 0), capacity 0 and nothing dropped. Nothing depends on the parameters, so
    gradients are exactly zero. Routing an empty batch instead would divide by S = 0 in the losses and take
    top-k over empty axes.
    """
    y = jnp.zeros(x.shape[:-1] + (config.output_dim,), x.dtype)
    if config.result_func is not None:
        y = config.result_func(y)
    aux = MoEAux(l_aux=jnp.zeros((), jnp.float32),
                 dispatch_count=jnp.zeros((config.num_global_experts,), jnp.int32),
                 capacity=jnp.zeros((), jnp.int32), dropped_fraction=jnp.zeros((), jnp.float32),
                 losses=zero_losses(gate))
    return y, aux


def moe_pipeline(
    params: dict,
    x: jax.Array,
    config: MoEConfig,
    call: CallOptions,
    *,
    rng: jax.Array | None = None,
    deterministic: bool = True,
    valid: jax.Array | None = None,
    run_experts: Callable | None = None,
    group: TokenGroup = LOCAL,
) -> tuple[jax.Array, MoEAux]:
    """The MoE layer on one device's tokens: the one pipeline every execution runs.

    x [..., M] -> tokens [S, M] -> route (gate, noise, plan, losses; capacity agreed over `group`) ->
    `run_experts(expert_params, tokens, plan, config) -> [S, M_out]` -> + shared experts -> y [..., M_out] in
    x's dtype -> `config.result_func`; aux from the plan, reduced over `group`.

    Single device: `group` LOCAL and the default runner `expert_paths.run_routed_experts` (capacity or
    dropless paths). Expert parallelism (`parallel.expert_parallel`, inside shard_map): the device's
    TokenGroup and an `ExchangeRunner` (exchange -> local experts -> exchange: 2DH, overlap chunks, sharded
    experts, dropless exchanges); expert-sliced serving: a runner over this device's slice of the experts.
    `valid` [...] (x without its last axis) masks padding tokens out of routing and the aux.
    """
    gate, _, _ = routing_args(config, call.gate_index, call.top_k, call.capacity_factor)
    if math.prod(x.shape[:-1]) == 0:
        return empty_result(x, config, gate)
    tokens = x.reshape(-1, config.model_dim).astype(config.dtype)
    mask = None if valid is None else valid.reshape(-1)
    plan, l_aux, losses = route(
        params["gates"][call.gate_index], tokens, config,
        top_k=call.top_k, capacity_factor=call.capacity_factor, gate_index=call.gate_index,
        rng=group.fold_rng(rng), deterministic=deterministic,
        alignment=config.sharded_count * call.overlap_degree(config), valid=mask,
        num_tokens_for_capacity=group.count_for_capacity(tokens.shape[0], mask),
        max_count_reduce=group.max_count_reduce,
        seq_len=x.shape[-2] if x.ndim >= 3 else None, return_losses=True,
    )
    y = (run_experts or run_routed_experts)(params["experts"], tokens, plan, config)
    y = apply_shared_experts(params, tokens, y, config)
    y = y.reshape(x.shape[:-1] + (y.shape[-1],)).astype(x.dtype)
    if config.result_func is not None:
        y = config.result_func(y)
    return y, _aux(plan, l_aux, losses, mask, group)


def _aux(plan: RoutingPlan, l_aux: jax.Array, losses: dict, mask: jax.Array | None, group: TokenGroup) -> MoEAux:
    """The call's MoEAux: this device's routing statistics, reduced over the group (l_aux and losses averaged,
    counts summed, the capacity the largest, the dropped fraction over every valid assignment)."""
    if group.is_local and mask is None:
        return MoEAux(l_aux=l_aux.astype(jnp.float32), dispatch_count=plan.dispatch_count,
                      capacity=plan.capacity, dropped_fraction=plan.dropped_fraction, losses=losses)
    num_tokens = plan.kept.shape[1]
    kept = plan.kept if mask is None else plan.kept & mask[None, :]
    total = plan.kept.shape[0] * (num_tokens if mask is None else jnp.sum(mask.astype(jnp.int32)))
    dropped = total - jnp.sum(kept.astype(jnp.int32))
    return MoEAux(
        l_aux=group.mean(l_aux.astype(jnp.float32)),
        dispatch_count=group.sum(plan.dispatch_count),
        capacity=group.max(plan.capacity),
        dropped_fraction=(group.sum(dropped).astype(jnp.float32)
                          / jnp.maximum(group.sum(total), 1).astype(jnp.float32)),
        losses=jax.tree.map(lambda v: group.mean(v.astype(jnp.float32)), losses),
    )


def moe_apply(
    params: dict,
    x: jax.Array,
    config: MoEConfig,
    *,
    top_k: int | None = None,
    capacity_factor: float | None = None,
    gate_index: int = 0,
    rng: jax.Array | None = None,
    deterministic: bool = True,
    a2a_ffn_overlap_degree: int | None = None,
    valid: jax.Array | None = None,
    run_experts: Callable | None = None,
) -> tuple[jax.Array, MoEAux]:
    """Runs the MoE layer on one device (`moe_pipeline` with the local runner).

    Args:
      params: from `init_params` (or a Tutel checkpoint).
      x: [..., M] input; flattened to S tokens batch-major.
      config: the layer's MoEConfig (static).
      top_k, capacity_factor, gate_index: per-call overrides of the gate's defaults (static).
        capacity_factor: > 0 fixed, 0 dropless, < 0 bounded dropless (Tutel semantics).
      rng: key for the gate noise (used only when not deterministic and gate_noise > 0).
      deterministic: no gate noise (Tutel's eval mode).
      a2a_ffn_overlap_degree: per-call override; it aligns the capacity like in Tutel.
      valid: [...] bool (x without its last axis) or None: padding tokens (False) take no expert slot, get a
        zero routed-expert output (shared experts still run on them) and count nowhere in aux.
      run_experts: how the routed experts run, `fn(expert_params, tokens [S, M], plan, config) -> [S, M_out]`
        (default `run_routed_experts`: all of them here; `parallel.expert_sliced` runs this device's slice).

    Returns:
      (y, aux): y has x's shape (last dim the expert output dim) and dtype; aux is a MoEAux.
      A NaN token gives a NaN output row and a NaN aux loss; other tokens are unaffected; it never raises.
      An input without tokens (e.g. [0, M] or [B, 0, M]) gives an empty y and a zero aux (`empty_result`).

    Raises:
      TypeError for a non-floating x; ValueError for a wrong shape or bad per-call options (`routing_args`).
    """
    check_input(x, config.model_dim, valid=valid)
    call = CallOptions(top_k=top_k, capacity_factor=capacity_factor, gate_index=gate_index,
                       a2a_ffn_overlap_degree=a2a_ffn_overlap_degree)
    return moe_pipeline(params, x, config, call, rng=rng, deterministic=deterministic, valid=valid,
                        run_experts=run_experts)
