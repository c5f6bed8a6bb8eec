"""The MoE layer as pure functions: `init_params` and `moe_apply`.

Data flows one way: x -> gate logits -> (noise) -> softmax scores -> routing plan -> encode -> experts ->
decode -> y, plus the aux loss from the scores. `moe_apply` works under `jax.jit` and `jax.grad` with the config
and per-call switches static.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from . import dispatch
from . import dropless
from . import expert_loop
from . import native
from .config import MoEConfig
from .losses import gshard_loss, load_importance_loss
from .routing.plan import RoutingPlan, plan_from_choices, top_k_routing
from .routing.gates import Gate
from .routing.router_plan import is_router_gate, route_with_router, zero_losses
from .validation import check_capacity_factor, check_input

__all__ = ["MoEAux", "init_params", "moe_apply", "run_routed_experts", "route", "apply_shared_experts",
           "routing_args", "empty_result"]


@dataclasses.dataclass(frozen=True)
class MoEAux:
    """What one call of the layer reports besides its output.

    Attributes:
      l_aux: [] float32 load-balancing loss.
      dispatch_count: [E] int32 assignments per expert before dropping.
      capacity: [] int32 Tutel's capacity C.
      dropped_fraction: [] float32 fraction of the k*S assignments dropped.
      losses: {name: [] float32} every balance loss a router gate computes ('switch', 'gshard', 'seq_aux',
        'z_loss'; see `routing.router_plan`), unweighted; empty for Tutel's gates.
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

    Router gates (with `select` or `plan`: Mixtral, DeepSeek-V3, GPT-OSS, expert choice, ...) go through
    `routing.router_plan.route_with_router`; Tutel's gates through softmax + `top_k_routing`. With
    `config.kernel_backend` and no `valid`, the fused gating kernel chooses experts and slots for Tutel's gates
    and for the router gates it reproduces exactly (see `kernel_gating` on the gates). `seq_len` (tokens
    per sequence) is used by the sequence-wise loss. With `return_losses` the result is (plan, l_aux, losses).
    """
    gate, k, cf = routing_args(config, gate_index, top_k, capacity_factor)
    num_experts = config.num_global_experts
    if is_router_gate(gate):
        plan, l_aux, losses = route_with_router(
            gate, gate_params, x, num_experts, top_k=k, capacity_factor=cf, rng=rng, deterministic=deterministic,
            batch_prioritized_routing=config.batch_prioritized_routing, alignment=alignment, valid=valid,
            num_tokens_for_capacity=num_tokens_for_capacity, max_count_reduce=max_count_reduce, seq_len=seq_len,
            kernel_backend=config.kernel_backend)
        return (plan, l_aux, losses) if return_losses else (plan, l_aux)

    logits = gate.logits(gate_params, x)
    noisy = logits
    if not deterministic and gate.gate_noise > 0:
        if rng is None:
            raise ValueError("gate_noise > 0 in training mode needs an `rng` key (or call with deterministic=True)")
        noise = jax.random.normal(rng, logits.shape, jnp.float32).astype(logits.dtype)
        noisy = logits + gate.gate_noise * noise / num_experts
    scores = jax.nn.softmax(noisy, axis=1)

    if config.kernel_backend is not None and valid is None:
        plan = _kernel_top_k_routing(scores, noisy, k, cf, config, alignment, num_tokens_for_capacity,
                                     max_count_reduce)
    else:
        plan = top_k_routing(
            scores, k, cf,
            batch_prioritized_routing=config.batch_prioritized_routing,
            normalize_gate=config.normalize_gate,
            alignment=alignment,
            valid=valid,
            num_tokens_for_capacity=num_tokens_for_capacity,
            max_count_reduce=max_count_reduce,
        )
    if config.is_gshard_loss:
        l_aux = gshard_loss(scores, plan.expert_ids, valid)
    else:
        top_logits = jnp.take_along_axis(noisy, plan.expert_ids.T, axis=1)
        l_aux = load_importance_loss(jax.nn.softmax(logits, axis=1), top_logits, num_experts, gate.gate_noise, valid)
    return (plan, l_aux, {}) if return_losses else (plan, l_aux)


def routing_args(config: MoEConfig, gate_index: int = 0, top_k: int | None = None,
                 capacity_factor: float | None = None) -> tuple[Gate, int, float]:
    """(gate, k, cf) of one call: the per-call overrides, or the gate's defaults, checked.

    Raises ValueError for a bad gate_index, a k that is not an integer >= 1, a capacity factor that is not a
    finite number (`validation.check_capacity_factor`), and cf <= 0 for expert-choice routing (its capacity is
    fixed). Every call checks them, whatever the batch, even one without tokens (`moe_apply` skips routing).
    """
    gate = config.gate(gate_index)
    k = gate.k if top_k is None else top_k
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"top_k must be an integer >= 1, got {k!r}")
    cf = check_capacity_factor(gate.capacity_factor if capacity_factor is None else capacity_factor)
    if callable(getattr(gate, "plan", None)) and not cf > 0:
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


def _kernel_top_k_routing(scores, noisy, k, cf, config: MoEConfig, alignment, num_tokens_for_capacity,
                          max_count_reduce) -> RoutingPlan:
    """Tutel's top-k routing with the fused gating kernel choosing experts and slots (integer outputs); the
    combine weights are re-gathered from `scores` so gradients reach the gate as on the plain path."""
    import pallas_kernels
    fused = pallas_kernels.gating(jax.lax.stop_gradient(noisy), k, score_fn="softmax",
                                  normalize=config.normalize_gate,
                                  batch_prioritized_routing=config.batch_prioritized_routing,
                                  implementation=config.kernel_backend)
    ids = fused.expert_ids
    gates = jnp.take_along_axis(scores, ids.T, axis=1).T  # [k, S]
    if ids.shape[0] > 1 and config.normalize_gate:
        gates = gates / jnp.maximum(jnp.sum(gates, axis=0, keepdims=True), jnp.finfo(gates.dtype).eps)
    return plan_from_choices(ids, gates, config.num_global_experts, cf, alignment=alignment,
                             num_tokens_for_capacity=num_tokens_for_capacity, max_count_reduce=max_count_reduce,
                             slots=(fused.locations, fused.counts))


def run_experts_dropless(expert_params, x, plan: RoutingPlan, config: MoEConfig, load_experts: int | None = None
                         ) -> jax.Array:
    """Dropless path: permute -> grouped experts -> unpermute with no [E, C, M] padding ('ragged'), or the
    capacity path at the smallest static bucket holding every assignment ('bucketed', see `tutel_jax.dropless`).

    load_experts: how many experts the k*S assignments spread over (default plan.num_experts; a plan over one
    device's n of E experts passes E): the balanced load k*S/E sets 'auto' and the bucket ladder."""
    experts = config.experts
    grouped = getattr(experts, "grouped", None)
    spread = plan.num_experts if load_experts is None else int(load_experts)
    impl = dropless.resolve_impl(config.dropless_impl, experts, plan.top_k * x.shape[0], spread)
    if impl == "gather":
        return _run_gathered(expert_params, x, plan, config)
    if impl == "loop":
        return _run_looped(expert_params, x, plan, config)
    if impl == "native":
        return _run_native(config, expert_params, x, plan)
    if impl == "bucketed":
        caps = dropless.bucket_capacities(x.shape[0], spread, plan.top_k)
        caps = dropless.extend_for_cpu(caps, x.shape[0], plan.num_experts, x.shape[1] * x.dtype.itemsize)
        if grouped is not None:  # bounded padding: beyond 4x the balanced load, fall back to the ragged path
            overflow = (lambda: _run_ragged(expert_params, x, plan, config)) if caps[-1] < x.shape[0] else None
        else:  # no grouped(): the ladder goes up to S, which always fits
            caps = caps + ((x.shape[0],) if caps[-1] < x.shape[0] else ())
            overflow = None
        return dropless.run_bucketed(plan, caps, lambda p: run_experts_buffered(expert_params, x, p, config), overflow)
    if grouped is None:
        try:
            capacity = int(plan.capacity)  # concrete outside jit: use an exactly sized buffer
        except jax.errors.ConcretizationTypeError:
            raise ValueError("capacity_factor=0 (dropless) under jit needs experts with a grouped() method; "
                             f"{type(experts).__name__} has none. Use capacity_factor < 0 to bound the "
                             "capacity, dropless_impl='bucketed', or call outside jit.") from None
        return run_experts_buffered(expert_params, x, plan.with_buffer_capacity(capacity), config)
    return _run_ragged(expert_params, x, plan, config)


def _run_gathered(expert_params, x, plan: RoutingPlan, config: MoEConfig) -> jax.Array:
    """Dropless for a few tokens: the k*S assignments [k*S, M] each through their own expert (`gathered`)."""
    k, num_tokens = plan.expert_ids.shape
    enc, dec = dispatch.assignment_weights(plan, config.is_postscore)  # [k, S] each, 0 for unkept assignments
    rows = (x.astype(enc.dtype)[None] * enc[..., None]).reshape(k * num_tokens, -1).astype(x.dtype)
    out = config.experts.gathered(expert_params, rows, plan.expert_ids.reshape(-1))  # [k*S, M_out]
    return jnp.sum(out.reshape(k, num_tokens, -1).astype(dec.dtype) * dec[..., None], axis=0)


def _run_looped(expert_params, x, plan: RoutingPlan, config: MoEConfig) -> jax.Array:
    """Dropless as a loop over the used experts (`expert_loop`): permute -> loop -> unpermute."""
    return _run_ragged(expert_params, x, plan, config,
                       grouped=lambda p, rows, sizes: expert_loop.grouped(config.experts, p, rows, sizes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _run_native(config: MoEConfig, expert_params, x, plan: RoutingPlan) -> jax.Array:
    """Dropless through the native CPU kernel (`tutel_jax.native.moe_swiglu`: float32 compute), in the gates'
    dtype like the other paths. Gradients: the 'loop' path's VJP (the kernel is a serving path)."""
    enc, dec = dispatch.assignment_weights(plan, config.is_postscore)
    y = native.moe_swiglu(x, plan.expert_ids, enc, dec, expert_params["gate_up_proj"], expert_params["down_proj"])
    return y.astype(plan.gates.dtype)


def _run_native_fwd(config, expert_params, x, plan):
    return _run_native(config, expert_params, x, plan), (expert_params, x, plan)


def _run_native_bwd(config, residuals, g):
    _, vjp = jax.vjp(lambda p, x, plan: _run_looped(p, x, plan, config), *residuals)
    return vjp(g)


_run_native.defvjp(_run_native_fwd, _run_native_bwd)


def _run_ragged(expert_params, x, plan: RoutingPlan, config: MoEConfig, grouped=None) -> jax.Array:
    """permute -> grouped experts (`config.experts.grouped`, or `grouped(params, rows, sizes)`) -> unpermute."""
    rows = dispatch.permute(x, plan, config.is_postscore, config.kernel_backend).astype(x.dtype)
    out = (grouped or config.experts.grouped)(expert_params, rows, plan.dispatch_count)
    return dispatch.unpermute(out, plan, config.is_postscore, config.kernel_backend)


def run_experts_buffered(expert_params, x, plan: RoutingPlan, config: MoEConfig) -> jax.Array:
    """Capacity path: encode into [E, C, M], run the experts, decode."""
    buf = dispatch.fast_encode(x, plan, config.is_postscore, config.kernel_backend).astype(x.dtype)  # [E, C, M]
    out = config.experts.batched(expert_params, buf)  # [E, C, M_out]
    return dispatch.fast_decode(out, plan, config.is_postscore, config.kernel_backend)


def run_routed_experts(expert_params, tokens: jax.Array, plan: RoutingPlan, config: MoEConfig,
                       load_experts: int | None = None) -> jax.Array:
    """The routed experts' combined output [S, M_out] for tokens [S, M] under `plan` (dropless or capacity;
    `load_experts` as in `run_experts_dropless`)."""
    if plan.buffer_capacity is None:
        return run_experts_dropless(expert_params, tokens, plan, config, load_experts)
    return run_experts_buffered(expert_params, tokens, plan, config)


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
    run_experts: Callable | None = None,
) -> tuple[jax.Array, MoEAux]:
    """Runs the MoE layer on one device.

    Args:
      params: from `init_params` (or a Tutel checkpoint).
      x: [..., M] input; flattened to S tokens batch-major.
      config: the layer's MoEConfig (static).
      top_k, capacity_factor, gate_index: per-call overrides of the gate's defaults (static).
        capacity_factor: > 0 fixed, 0 dropless, < 0 bounded dropless (Tutel semantics).
      rng: key for the gate noise (used only when not deterministic and gate_noise > 0).
      deterministic: no gate noise (Tutel's eval mode).
      a2a_ffn_overlap_degree: per-call override; it aligns the capacity like in Tutel.
      run_experts: how the routed experts run, `fn(expert_params, tokens [S, M], plan, config) -> [S, M_out]`
        (default `run_routed_experts`: all of them here; `parallel.expert_sliced` runs this device's slice).

    Returns:
      (y, aux): y has x's shape (last dim the expert output dim) and dtype; aux is a MoEAux.
      A NaN token gives a NaN output row and a NaN aux loss; other tokens are unaffected; it never raises.
      An input without tokens (e.g. [0, M] or [B, 0, M]) gives an empty y and a zero aux (`empty_result`).

    Raises:
      TypeError for a non-floating x; ValueError for a wrong shape or bad per-call options (`routing_args`).
    """
    check_input(x, config.model_dim)
    gate, _, _ = routing_args(config, gate_index, top_k, capacity_factor)  # before indexing the parameters
    if math.prod(x.shape[:-1]) == 0:
        return empty_result(x, config, gate)
    orig_shape, orig_dtype = x.shape, x.dtype
    tokens = x.reshape(-1, config.model_dim).astype(config.dtype)
    degree = config.a2a_ffn_overlap_degree if a2a_ffn_overlap_degree is None else int(a2a_ffn_overlap_degree)
    plan, l_aux, losses = route(
        params["gates"][gate_index], tokens, config,
        top_k=top_k, capacity_factor=capacity_factor, gate_index=gate_index, rng=rng,
        deterministic=deterministic, alignment=config.sharded_count * degree,
        seq_len=orig_shape[-2] if len(orig_shape) >= 3 else None, return_losses=True,
    )
    y = (run_experts or run_routed_experts)(params["experts"], tokens, plan, config)
    y = apply_shared_experts(params, tokens, y, config)
    y = y.reshape(orig_shape[:-1] + (y.shape[-1],)).astype(orig_dtype)
    if config.result_func is not None:
        y = config.result_func(y)
    aux = MoEAux(l_aux=l_aux.astype(jnp.float32), dispatch_count=plan.dispatch_count, capacity=plan.capacity,
                 dropped_fraction=plan.dropped_fraction, losses=losses)
    return y, aux
