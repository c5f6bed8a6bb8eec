"""How the routed experts run on one device's tokens: the capacity path and the dropless paths.

`run_routed_experts(expert_params, tokens [S, M], plan, config) -> [S, M_out]` is the default experts runner of
`layer.moe_pipeline`: the capacity path (`run_experts_buffered`: encode into [E, C, M], `experts.batched`,
decode) for a plan with a buffer capacity, else the dropless path that `config.dropless_impl` resolves to. The
dropless paths are one registry (`experts.DROPLESS_PATHS`), filled here:
  ragged    permute -> `experts.grouped` -> unpermute (no padding)
  bucketed  the capacity path at the smallest static bucket holding every assignment (ragged beyond the ladder)
  loop      the ragged path with the grouped matmul as a loop over the used experts (`expert_loop`)
  gather    each assignment through its own expert's gathered weights (`experts.gathered`)
  native    the C++ CPU kernel (`experts.native` -> `native.moe_experts`), gradients through 'loop'
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .. import routing
from ._config import MoEConfig
from ..experts import (DROPLESS_PATHS, DroplessPath, bucket_capacities, check_native, expert_loop, extend_for_cpu,
                       register_dropless_path, resolve_impl, run_bucketed)
from ..routing import RoutingPlan

__all__ = ["run_experts_buffered", "run_experts_dropless", "run_routed_experts"]


def run_experts_buffered(expert_params, x, plan: RoutingPlan, config: MoEConfig) -> jax.Array:
    """Capacity path: encode x [S, M] into [E, C, M], run the experts, decode to [S, M_out]."""
    buf = routing.fast_encode(x, plan, config.is_postscore, config.kernel_backend).astype(x.dtype)  # [E, C, M]
    out = config.experts.batched(expert_params, buf)  # [E, C, M_out]
    return routing.fast_decode(out, plan, config.is_postscore, config.kernel_backend)


def run_experts_dropless(expert_params, x, plan: RoutingPlan, config: MoEConfig, load_experts: int | None = None
                         ) -> jax.Array:
    """Dropless path (plan without a buffer capacity) for x [S, M] -> [S, M_out], through the registered path
    that `config.dropless_impl` resolves to (`experts.resolve_impl`).

    load_experts: how many experts the k*S assignments spread over (default plan.num_experts; a plan over one
    device's n of E experts passes E): the balanced load k*S/E sets 'auto' and the bucket ladder."""
    spread = plan.num_experts if load_experts is None else int(load_experts)
    impl = resolve_impl(config.dropless_impl, config.experts, plan.top_k * x.shape[0], spread)
    return DROPLESS_PATHS[impl].run(expert_params, x, plan, config, spread)


def run_routed_experts(expert_params, tokens: jax.Array, plan: RoutingPlan, config: MoEConfig,
                       load_experts: int | None = None) -> jax.Array:
    """The routed experts' combined output [S, M_out] for tokens [S, M] under `plan` (dropless or capacity;
    `load_experts` as in `run_experts_dropless`)."""
    if plan.buffer_capacity is None:
        return run_experts_dropless(expert_params, tokens, plan, config, load_experts)
    return run_experts_buffered(expert_params, tokens, plan, config)


def _run_ragged(expert_params, x, plan: RoutingPlan, config: MoEConfig, grouped=None) -> jax.Array:
    """permute -> grouped experts (`config.experts.grouped`, or `grouped(params, rows, sizes)`) -> unpermute."""
    rows = routing.permute(x, plan, config.is_postscore, config.kernel_backend).astype(x.dtype)
    out = (grouped or config.experts.grouped)(expert_params, rows, plan.dispatch_count)
    return routing.unpermute(out, plan, config.is_postscore, config.kernel_backend)


def _ragged(expert_params, x, plan: RoutingPlan, config: MoEConfig, spread: int) -> jax.Array:
    if config.experts.grouped is not None:
        return _run_ragged(expert_params, x, plan, config)
    try:  # no grouped(): an exactly sized capacity buffer, possible only outside jit
        capacity = int(plan.capacity)
    except jax.errors.ConcretizationTypeError:
        raise ValueError("capacity_factor=0 (dropless) under jit needs experts with a grouped() method; "
                         f"{type(config.experts).__name__} has none. Use capacity_factor < 0 to bound the "
                         "capacity, dropless_impl='bucketed', or call outside jit.") from None
    return run_experts_buffered(expert_params, x, plan.with_buffer_capacity(capacity), config)


def _bucketed(expert_params, x, plan: RoutingPlan, config: MoEConfig, spread: int) -> jax.Array:
    caps = bucket_capacities(x.shape[0], spread, plan.top_k)
    caps = extend_for_cpu(caps, x.shape[0], plan.num_experts, x.shape[1] * x.dtype.itemsize)
    if config.experts.grouped is not None:
        # bounded padding: beyond 4x the balanced load, fall back to the ragged path
        overflow = (lambda: _run_ragged(expert_params, x, plan, config)) if caps[-1] < x.shape[0] else None
    else:  # no grouped(): the ladder goes up to S, which always fits
        caps = caps + ((x.shape[0],) if caps[-1] < x.shape[0] else ())
        overflow = None
    return run_bucketed(plan, caps, lambda p: run_experts_buffered(expert_params, x, p, config), overflow)


def _gathered(expert_params, x, plan: RoutingPlan, config: MoEConfig, spread: int = 0) -> jax.Array:
    """Dropless for a few tokens: the k*S assignments [k*S, M] each through their own expert (`gathered`)."""
    k, num_tokens = plan.expert_ids.shape
    enc, dec = routing.assignment_weights(plan, config.is_postscore)  # [k, S] each, 0 for unkept assignments
    rows = (x.astype(enc.dtype)[None] * enc[..., None]).reshape(k * num_tokens, -1).astype(x.dtype)
    out = config.experts.gathered(expert_params, rows, plan.expert_ids.reshape(-1))  # [k*S, M_out]
    return jnp.sum(out.reshape(k, num_tokens, -1).astype(dec.dtype) * dec[..., None], axis=0)


def _looped(expert_params, x, plan: RoutingPlan, config: MoEConfig, spread: int = 0) -> jax.Array:
    """Dropless as a loop over the used experts (`expert_loop`): permute -> loop -> unpermute."""
    return _run_ragged(expert_params, x, plan, config,
                       grouped=lambda p, rows, sizes: expert_loop.grouped(config.experts, p, rows, sizes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _run_native(config: MoEConfig, activations: str, expert_params, x, plan: RoutingPlan) -> jax.Array:
    """Dropless through the native CPU kernel (`experts.native` -> `tutel_jax.native.moe_experts`: float32
    compute, packed weights decoded in registers; `activations` 'int8' for the int8 dot products of FP4 weights),
    in the gates' dtype like the other paths. Gradients: the 'loop' path's VJP (the kernel is a serving path)."""
    enc, dec = routing.assignment_weights(plan, config.is_postscore)
    return config.experts.native(expert_params, x, plan.expert_ids, enc, dec, activations).astype(plan.gates.dtype)


def _run_native_fwd(config, activations, expert_params, x, plan):
    return _run_native(config, activations, expert_params, x, plan), (expert_params, x, plan)


def _run_native_bwd(config, activations, residuals, g):
    _, vjp = jax.vjp(lambda p, x, plan: _looped(p, x, plan, config), *residuals)
    return vjp(g)


_run_native.defvjp(_run_native_fwd, _run_native_bwd)


for _path in (
        DroplessPath("ragged", _ragged),
        DroplessPath("bucketed", _bucketed),
        DroplessPath("loop", _looped),
        DroplessPath("gather", _gathered, requires="gathered"),
        DroplessPath("native", lambda p, x, plan, config, spread: _run_native(config, "float32", p, x, plan),
                     check=check_native),
        DroplessPath("native_int8", lambda p, x, plan, config, spread: _run_native(config, "int8", p, x, plan),
                     check=check_native)):
    register_dropless_path(_path)
