"""Expert parallelism: the MoE layer over a device mesh with `shard_map` and `all_to_all`.

Every device routes its own tokens exactly like a Tutel rank (local S, capacity from local S, or from the
maximum over the expert group with `inequivalent_tokens`), encodes them into [E, C, M], exchanges buffers with
the devices of the expert axes, runs its own n = E / W experts on [n, W*C, M], exchanges back and decodes.
With `a2a_ffn_overlap_degree = d` the capacity axis is split into d independent chunks, so XLA can overlap
one chunk's all_to_all with another chunk's expert matmuls.

Sharded experts (count_per_node = -s, E = W / s): the W devices of the expert axes are laid out as
(E, s/r, r) for Tutel's adaptive r: each expert's capacity is split over s/r replicas, and inside a replica the
r devices hold 1/r of the expert's hidden units (tensor parallel), their partial outputs summed after the
reverse exchange. r = 1 gathers whole experts; r = s is pure tensor parallelism; r = 0 gathers every expert on
every device and skips the all_to_all (data parallel; also valid with count_per_node > 0).

Arrays are global: x [B, ..., M] with its leading axis sharded over the token axes; expert parameters [E, ...]
sharded along their first axis over the expert axes (sharded experts: also along their hidden axis); gate
parameters replicated. Gradients of replicated
parameters are summed over devices by `shard_map`'s transpose, so any loss written on the global arrays gets
the right gradients.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .. import dispatch
from .. import dropless
from ..config import MoEConfig
from ..layer import (MoEAux, apply_shared_experts, empty_result, route, routing_args, run_experts_buffered,
                     run_experts_dropless)
from ..routing.plan import align_capacity
from ..validation import check_input
from .all_to_all import expert_all_to_all, expert_all_to_all_reverse

__all__ = ["ExpertParallel", "moe_apply_parallel", "param_shardings", "shard_params", "shard_map"]


def shard_map(fn, mesh, in_specs, out_specs):
    """`jax.shard_map` (or `jax.experimental.shard_map.shard_map` on older JAX)."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    from jax.experimental.shard_map import shard_map as legacy  # older JAX
    return legacy(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def _as_axes(axes: str | Sequence[str]) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes)


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """Where an MoE layer runs.

    Attributes:
      mesh: the device mesh.
      expert_axes: mesh axes forming the all_to_all group (W = product of their sizes); with `use_2dh` a
        (node, local) pair.
      token_axes: mesh axes the tokens' leading dimension is sharded over (must include the expert axes);
        defaults to all mesh axes. Other mesh axes see the same tokens (e.g. a tensor-parallel 'model' axis).
    """

    mesh: Mesh
    expert_axes: tuple[str, ...] = ("expert",)
    token_axes: tuple[str, ...] | None = None

    def __post_init__(self):
        expert_axes = _as_axes(self.expert_axes)
        token_axes = tuple(self.mesh.axis_names) if self.token_axes is None else _as_axes(self.token_axes)
        object.__setattr__(self, "expert_axes", expert_axes)
        object.__setattr__(self, "token_axes", token_axes)
        names = set(self.mesh.axis_names)
        for axis in expert_axes + token_axes:
            if axis not in names:
                raise ValueError(f"mesh axis {axis!r} not in the mesh's axes {tuple(self.mesh.axis_names)}")
        missing = [a for a in expert_axes if a not in token_axes]
        if missing:
            raise ValueError(f"expert axes {missing} must also be token axes: every expert-parallel rank routes "
                             f"its own tokens (token_axes={token_axes})")

    @property
    def world_size(self) -> int:
        """W: devices in the all_to_all group."""
        size = 1
        for axis in self.expert_axes:
            size *= self.mesh.shape[axis]
        return size

    @property
    def num_token_shards(self) -> int:
        size = 1
        for axis in self.token_axes:
            size *= self.mesh.shape[axis]
        return size

    def token_spec(self) -> P:
        return P(self.token_axes)

    def expert_spec(self) -> P:
        return P(self.expert_axes)


EXPERT_AXES = ("_moe_e", "_moe_q", "_moe_t")  # (expert, capacity replica, tensor-parallel) for sharded experts


def _hidden_axes(config: MoEConfig, expert_params: Any) -> Any:
    fn = getattr(config.experts, "hidden_axes", None)
    if fn is None:
        raise ValueError(f"sharded experts need an expert type with hidden_axes(); {type(config.experts).__name__} "
                         "has none")
    return fn(expert_params)


def sharded_layout(placement: ExpertParallel, sharded_count: int, r: int) -> tuple[Mesh, tuple[str, ...]]:
    """The mesh as (other axes..., E, s/r, r) for sharded experts, and the token axes on it.

    Devices keep their flat expert-axis order (device w = e*s + q*r + t), so arrays laid out for the original
    mesh keep their layout."""
    mesh, expert_axes = placement.mesh, placement.expert_axes
    names = list(mesh.axis_names)
    others = [a for a in names if a not in expert_axes]
    devices = mesh.devices.transpose([names.index(a) for a in others + list(expert_axes)])
    replicas = sharded_count // r if r else sharded_count
    tp = r if r else 1
    devices = devices.reshape(devices.shape[:len(others)] + (placement.world_size // sharded_count, replicas, tp))
    tokens = list(placement.token_axes)
    first = tokens.index(expert_axes[0])
    if tuple(tokens[first:first + len(expert_axes)]) != expert_axes:
        raise ValueError(f"sharded experts need the expert axes {expert_axes} to appear together, in order, in the "
                         f"token axes {placement.token_axes}")
    tokens[first:first + len(expert_axes)] = EXPERT_AXES
    return Mesh(devices, tuple(others) + EXPERT_AXES), tuple(tokens)


def param_specs(params: Any, placement: ExpertParallel, config: MoEConfig | None = None) -> Any:
    """PartitionSpecs for a layer's parameter pytree: experts split on their first axis, gates replicated.

    For sharded experts (config.sharded_count > 1) the specs refer to `sharded_layout`'s mesh: each expert's
    hidden axis is split over its s devices as well."""
    gates = jax.tree.map(lambda _: P(), params["gates"])
    extra = {}
    if "shared_experts" in params:  # dense shared experts: replicated on every device
        extra["shared_experts"] = jax.tree.map(lambda _: P(), params["shared_experts"])
    if config is None or config.sharded_count == 1:
        return {"gates": gates, "experts": jax.tree.map(lambda _: placement.expert_spec(), params["experts"]),
                **extra}
    e, q, t = EXPERT_AXES

    def spec(leaf, axis):
        parts = [e] + [None] * (leaf.ndim - 1)
        if axis is not None:
            parts[axis] = (q, t)
        return P(*parts)

    return {"gates": gates, "experts": jax.tree.map(spec, params["experts"], _hidden_axes(config, params["experts"])),
            **extra}


def param_shardings(params: Any, placement: ExpertParallel, config: MoEConfig | None = None) -> Any:
    mesh = placement.mesh
    if config is not None and config.sharded_count > 1:
        mesh = sharded_layout(placement, config.sharded_count, config.sharded_count)[0]
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(params, placement, config),
                        is_leaf=lambda s: isinstance(s, P))


def shard_params(params: Any, placement: ExpertParallel, config: MoEConfig | None = None) -> Any:
    """Places a global parameter pytree on the mesh (each device gets only its own experts, or for sharded
    experts its slice of its expert's hidden units). Pass `config` for sharded experts."""
    return jax.device_put(params, param_shardings(params, placement, config))


def _check_global_shapes(params, x, config: MoEConfig, placement: ExpertParallel, valid):
    W = placement.world_size
    n = config.num_local_experts
    expected = n * W if n > 0 else (W // -n if W % -n == 0 else None)
    if config.num_global_experts != expected:
        raise ValueError(f"config has {config.num_global_experts} global experts, which count_per_node={n} does not "
                         f"give on an expert axis of {W} devices; build the config with world_size={W}")
    check_input(x, config.model_dim, min_ndim=2)
    shards = placement.num_token_shards
    if x.shape[0] % shards:
        raise ValueError(f"x's leading dimension {x.shape[0]} must be divisible by the {shards} token shards "
                         f"(mesh axes {placement.token_axes})")
    if valid is not None and tuple(valid.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"valid must have shape {tuple(x.shape[:-1])} (x without its last axis), got {valid.shape}")
    for leaf in jax.tree.leaves(params["experts"]):
        if leaf.shape[0] != config.num_global_experts:
            raise ValueError(f"expert parameters must be global with E={config.num_global_experts} rows, "
                             f"got a leaf of shape {leaf.shape}")


def moe_apply_parallel(
    params: dict,
    x: jax.Array,
    config: MoEConfig,
    placement: ExpertParallel,
    *,
    top_k: int | None = None,
    capacity_factor: float | None = None,
    gate_index: int = 0,
    rng: jax.Array | None = None,
    deterministic: bool = True,
    a2a_ffn_overlap_degree: int | None = None,
    use_2dh: bool | None = None,
    valid: jax.Array | None = None,
    inequivalent_tokens: bool = False,
    adaptive_r: int | None = None,
    dropless_exchange: str = "padded",
    recv_capacity: int | None = None,
) -> tuple[jax.Array, MoEAux]:
    """Expert-parallel MoE over `placement.mesh`.

    Args:
      params: global parameters (`init_params` with the config built for world_size = W).
      x: [B, ..., M] global tokens; B is split over the token axes, each device routes its own [B/D * ..., M].
      config: MoEConfig with E = count_per_node * W.
      placement: mesh and axes.
      top_k, capacity_factor, gate_index, rng, deterministic: as in `moe_apply`.
      a2a_ffn_overlap_degree: chunks of the capacity axis (default from the config).
      use_2dh: hierarchical all_to_all over the two expert axes (default from the config).
      valid: optional [B, ...] bool marking real tokens; padding tokens take no capacity and output 0.
      inequivalent_tokens: agree the capacity over the expert group from the largest valid token count.
      adaptive_r: Tutel's r for this call (default from `config.parallel_type`): 0, or a divisor of the
        sharded count s (1 when experts are not sharded).
      dropless_exchange: how capacity_factor == 0 crosses devices: 'padded' (all_to_all of [E, C, M] at the
        smallest static bucket >= the group's max count, topped by S_local: never drops), 'ragged'
        (`lax.ragged_all_to_all`, see `parallel.ragged_dropless`; GPU/TPU only, with the padded path as the
        fallback beyond `recv_capacity`), 'auto' (ragged where the backend supports it, else padded), or
        'emulated' (the ragged algorithm over an all_to_all emulation of ragged_all_to_all: a CPU test stand-in).
        The ragged forms apply to flat expert axes with whole experts (count_per_node > 0, no 2DH); other
        layouts use 'padded'.
      recv_capacity: rows each device can receive in the ragged exchange (default 2 x k x S_local).

    Returns:
      (y [B, ..., M_out], aux) where aux.l_aux is the mean of the per-device losses, aux.dispatch_count the sum
      over devices, aux.capacity the capacity every device used, aux.dropped_fraction over all assignments.
    """
    _check_global_shapes(params, x, config, placement, valid)
    gate, _, _ = routing_args(config, gate_index, top_k, capacity_factor)
    degree = config.a2a_ffn_overlap_degree if a2a_ffn_overlap_degree is None else int(a2a_ffn_overlap_degree)
    if degree < 1:
        raise ValueError(f"a2a_ffn_overlap_degree must be >= 1, got {degree}")
    use_2dh = config.use_2dh if use_2dh is None else bool(use_2dh)
    r = config.adaptive_degree(adaptive_r)
    s = config.sharded_count
    if s > 1 and use_2dh:
        raise ValueError("use_2dh is not available with sharded experts (count_per_node < 0)")
    if s > 1:
        mesh, token_axes = sharded_layout(placement, s, r)
        expert_axes = EXPERT_AXES
    else:
        mesh, token_axes, expert_axes = placement.mesh, placement.token_axes, placement.expert_axes
    alignment = s * degree
    model_dim = config.model_dim
    if dropless_exchange not in ("padded", "ragged", "auto", "emulated"):
        raise ValueError(f"dropless_exchange must be 'padded', 'ragged', 'auto' or 'emulated', "
                         f"got {dropless_exchange!r}")
    exchange = None
    if dropless_exchange != "padded" and s == 1 and not use_2dh:
        from .ragged_dropless import emulated_ragged_all_to_all, ragged_supported
        if dropless_exchange == "emulated":
            exchange = emulated_ragged_all_to_all
        elif dropless_exchange == "ragged" or ragged_supported():
            exchange = lax.ragged_all_to_all
    if math.prod(x.shape[:-1]) == 0:  # no token on any device (B splits evenly): nothing to route or exchange
        return empty_result(x, config, gate)
    hidden_axes = _hidden_axes(config, params["experts"]) if s > 1 else None

    def gather_all_experts(local_params):
        """r = 0: every expert's full weights on every device."""
        def gather(leaf, axis=None):
            if s > 1 and axis is not None:
                leaf = lax.all_gather(leaf, EXPERT_AXES[1:], axis=axis, tiled=True)
            return lax.all_gather(leaf, expert_axes[:1] if s > 1 else expert_axes, axis=0, tiled=True)
        if s == 1:
            return jax.tree.map(gather, local_params)
        return jax.tree.map(gather, local_params, hidden_axes)

    def replica_params(local_params):
        """r >= 1, sharded experts: this device's 1/r of its expert's hidden units; output biases on t = 0 only."""
        first_tp = (lax.axis_index(EXPERT_AXES[2]) == 0)

        def take(leaf, axis):
            if axis is None:
                return leaf * first_tp.astype(leaf.dtype)
            return lax.all_gather(leaf, EXPERT_AXES[1], axis=axis, tiled=True)
        return jax.tree.map(take, local_params, hidden_axes)

    def exchange_and_compute(part, expert_params):
        """[E, c, M] slots -> [E, c, M_out] expert outputs, through the expert devices."""
        if s == 1:
            part = expert_all_to_all(part, expert_axes, use_2dh)  # [n, W*c, M]
            part = config.experts.batched(expert_params, part)
            return expert_all_to_all_reverse(part, expert_axes, use_2dh)
        num_experts, c, dim = part.shape
        replicas, tp = s // r, r
        piece = part.reshape(num_experts, replicas, 1, c // replicas, dim)
        piece = jnp.broadcast_to(piece, (num_experts, replicas, tp, c // replicas, dim))
        piece = piece.reshape(num_experts * replicas * tp, c // replicas, dim)  # one row block per device
        piece = expert_all_to_all(piece, expert_axes)  # [1, W*c/replicas, M]
        piece = config.experts.batched(expert_params, piece)
        piece = expert_all_to_all_reverse(piece, expert_axes)  # [W, c/replicas, M_out]
        piece = piece.reshape(num_experts, replicas, tp, c // replicas, piece.shape[-1]).sum(axis=2)
        return piece.reshape(num_experts, c, piece.shape[-1])

    def local(params, x, valid, rng):
        tokens = x.reshape(-1, model_dim).astype(config.dtype)
        mask = None if valid is None else valid.reshape(-1)
        num_tokens = tokens.shape[0]
        if rng is not None:
            rng = jax.random.fold_in(rng, lax.axis_index(token_axes))
        count_for_capacity = None
        if inequivalent_tokens:
            local_count = num_tokens if mask is None else jnp.sum(mask.astype(jnp.int32))
            count_for_capacity = lax.pmax(local_count, expert_axes)
        plan, l_aux, losses = route(
            params["gates"][gate_index], tokens, config, top_k=top_k, capacity_factor=capacity_factor,
            gate_index=gate_index, rng=rng, deterministic=deterministic, alignment=alignment, valid=mask,
            num_tokens_for_capacity=count_for_capacity, max_count_reduce=lambda c: lax.pmax(c, expert_axes),
            seq_len=x.shape[-2] if x.ndim >= 3 else None, return_losses=True)
        if r == 0:  # data parallel: all experts here, no exchange
            full = gather_all_experts(params["experts"])
            if plan.buffer_capacity is None:
                y = run_experts_dropless(full, tokens, plan, config)
            else:
                y = run_experts_buffered(full, tokens, plan, config)
        else:
            expert_params = params["experts"] if s == 1 else replica_params(params["experts"])

            def run_at(plan):
                buf = dispatch.fast_encode(tokens, plan, config.is_postscore, config.kernel_backend)
                buf = buf.astype(tokens.dtype)  # [E, C, M]
                chunk = buf.shape[1] // degree
                # independent chunks: chunk i's exchange can overlap chunk i-1's expert compute
                outputs = [exchange_and_compute(buf[:, i * chunk:(i + 1) * chunk], expert_params)
                           for i in range(degree)]
                out = outputs[0] if degree == 1 else jnp.concatenate(outputs, axis=1)
                return dispatch.fast_decode(out, plan, config.is_postscore, config.kernel_backend)

            if plan.buffer_capacity is None:
                # dropless across devices, padded all_to_all: the smallest of a few static capacities >= the
                # group's max count (plan.capacity, the same on every device, so every device takes the same
                # branch). Bound: a rank sends at most S_local assignments to one expert (a token's k experts
                # are distinct), so the top bucket, S_local, always fits: nothing is ever dropped.
                top = align_capacity(num_tokens, alignment)
                caps = dropless.bucket_capacities(num_tokens, config.num_global_experts, plan.top_k,
                                                  alignment=alignment, max_capacity=top)
                caps = caps + ((top,) if caps[-1] < top else ())
                padded = lambda: dropless.run_bucketed(plan, caps, run_at, need=plan.capacity)
                if exchange is None:
                    y = padded()
                else:
                    from .ragged_dropless import ragged_dropless_experts
                    y = ragged_dropless_experts(
                        tokens, plan, expert_params, config.experts, expert_axes, is_postscore=config.is_postscore,
                        recv_capacity=recv_capacity, fallback=padded, exchange=exchange).astype(tokens.dtype)
            else:
                y = run_at(plan)
        y = apply_shared_experts(params, tokens, y, config)
        y = y.reshape(x.shape[:-1] + (y.shape[-1],)).astype(x.dtype)
        kept = plan.kept if mask is None else plan.kept & mask[None, :]
        total = plan.kept.shape[0] * (num_tokens if mask is None else jnp.sum(mask.astype(jnp.int32)))
        dropped = total - jnp.sum(kept.astype(jnp.int32))
        aux = MoEAux(
            l_aux=lax.pmean(l_aux.astype(jnp.float32), token_axes),
            dispatch_count=lax.psum(plan.dispatch_count, token_axes),
            capacity=lax.pmax(plan.capacity, token_axes),
            dropped_fraction=(lax.psum(dropped, token_axes).astype(jnp.float32)
                              / jnp.maximum(lax.psum(total, token_axes), 1).astype(jnp.float32)),
            losses=jax.tree.map(lambda v: lax.pmean(v.astype(jnp.float32), token_axes), losses),
        )
        return y, aux

    token_spec = P(token_axes)
    specs = param_specs(params, placement, config)
    fn = shard_map(local, mesh,
                    in_specs=(specs, token_spec, None if valid is None else token_spec, None if rng is None else P()),
                    out_specs=(token_spec, P()))
    y, aux = fn(params, x, valid, rng)
    if config.result_func is not None:
        y = config.result_func(y)
    return y, aux
