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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core import CallOptions, TokenGroup
from ..layer import MoEConfig, MoEAux, empty_result, moe_pipeline, routing_args
from ..experts import as_experts
from ..validation import check_input
from ._exchange_runner import SHARDED_EXPERT_AXES, ExchangeRunner
from ._exchanges import resolve_exchange

__all__ = ["ExpertParallel", "moe_apply_parallel", "param_shardings", "shard_params", "shard_map"]


def shard_map(fn, mesh, in_specs, out_specs):
    """`jax.shard_map` with positional mesh and specs."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


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
        return math.prod(self.mesh.shape[axis] for axis in self.expert_axes)

    @property
    def num_token_shards(self) -> int:
        """Devices the tokens' leading axis is split over."""
        return math.prod(self.mesh.shape[axis] for axis in self.token_axes)

    def token_spec(self) -> P:
        return P(self.token_axes)

    def expert_spec(self) -> P:
        return P(self.expert_axes)


EXPERT_AXES = SHARDED_EXPERT_AXES  # (expert, capacity replica, tensor-parallel) for sharded experts


def _hidden_axes(config: MoEConfig, expert_params: Any) -> Any:
    experts = as_experts(config.experts)
    if experts.hidden_axes is None:
        raise ValueError(f"sharded experts need an expert type with hidden_axes(); {experts.type_name} has none")
    return experts.hidden_axes(expert_params)


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
    check_input(x, config.model_dim, min_ndim=2, valid=valid)
    shards = placement.num_token_shards
    if x.shape[0] % shards:
        raise ValueError(f"x's leading dimension {x.shape[0]} must be divisible by the {shards} token shards "
                         f"(mesh axes {placement.token_axes})")
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
    call = CallOptions(top_k=top_k, capacity_factor=capacity_factor, gate_index=gate_index,
                       a2a_ffn_overlap_degree=a2a_ffn_overlap_degree, use_2dh=use_2dh, adaptive_r=adaptive_r,
                       inequivalent_tokens=inequivalent_tokens, dropless_exchange=dropless_exchange,
                       recv_capacity=recv_capacity)
    gate, _, _ = routing_args(config, gate_index, top_k, capacity_factor)
    degree = call.overlap_degree(config)
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
    collective = resolve_exchange(dropless_exchange, ragged_layout=s == 1 and not use_2dh)
    if math.prod(x.shape[:-1]) == 0:  # no token on any device (B splits evenly): nothing to route or exchange
        return empty_result(x, config, gate)
    runner = ExchangeRunner(expert_axes=expert_axes, use_2dh=use_2dh, degree=degree, sharded_count=s,
                            adaptive_r=r, hidden_axes=_hidden_axes(config, params["experts"]) if s > 1 else None,
                            collective=collective, recv_capacity=recv_capacity)
    group = TokenGroup(token_axes=tuple(token_axes), expert_axes=tuple(expert_axes),
                       inequivalent_tokens=inequivalent_tokens)

    def local(params, x, valid, rng):
        return moe_pipeline(params, x, config, call, rng=rng, deterministic=deterministic, valid=valid,
                            run_experts=runner, group=group)

    token_spec = P(token_axes)
    specs = param_specs(params, placement, config)
    fn = shard_map(local, mesh,
                    in_specs=(specs, token_spec, None if valid is None else token_spec, None if rng is None else P()),
                    out_specs=(token_spec, P()))
    return fn(params, x, valid, rng)
