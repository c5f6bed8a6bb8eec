"""Expert parallelism: the MoE layer over a device mesh with `shard_map` and `all_to_all`.

Every device routes its own tokens exactly like a Tutel rank (local S, capacity from local S, or from the
maximum over the expert group with `inequivalent_tokens`), encodes them into [E, C, M], exchanges buffers with
the devices of the expert axes, runs its own n = E / W experts on [n, W*C, M], exchanges back and decodes.
With `a2a_ffn_overlap_degree = d` the capacity axis is split into d independent chunks, so XLA can overlap
one chunk's all_to_all with another chunk's expert matmuls.

Arrays are global: x [B, ..., M] with its leading axis sharded over the token axes; expert parameters [E, ...]
sharded along their first axis over the expert axes; gate parameters replicated. Gradients of replicated
parameters are summed over devices by `shard_map`'s transpose, so any loss written on the global arrays gets
the right gradients.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .. import dispatch
from ..config import MoEConfig
from ..layer import MoEAux, route
from ..routing.plan import align_capacity
from .all_to_all import expert_all_to_all, expert_all_to_all_reverse

__all__ = ["ExpertParallel", "moe_apply_parallel", "param_shardings", "shard_params"]


def _shard_map(fn, mesh, in_specs, out_specs):
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    from jax.experimental.shard_map import shard_map  # older JAX
    return shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


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


def param_specs(params: Any, placement: ExpertParallel) -> Any:
    """PartitionSpecs for a layer's parameter pytree: experts split on their first axis, gates replicated."""
    return {
        "gates": jax.tree.map(lambda _: P(), params["gates"]),
        "experts": jax.tree.map(lambda _: placement.expert_spec(), params["experts"]),
    }


def param_shardings(params: Any, placement: ExpertParallel) -> Any:
    return jax.tree.map(lambda spec: NamedSharding(placement.mesh, spec), param_specs(params, placement),
                        is_leaf=lambda s: isinstance(s, P))


def shard_params(params: Any, placement: ExpertParallel) -> Any:
    """Places a global parameter pytree on the mesh (each device gets only its own experts)."""
    return jax.device_put(params, param_shardings(params, placement))


def _check_global_shapes(params, x, config: MoEConfig, placement: ExpertParallel, valid):
    W = placement.world_size
    if config.num_local_experts < 0:
        raise ValueError("sharded experts (count_per_node < 0) are not supported by moe_apply_parallel yet")
    if config.num_global_experts != config.num_local_experts * W:
        raise ValueError(f"config has {config.num_global_experts} global experts but count_per_node="
                         f"{config.num_local_experts} x expert-axis size {W} = {config.num_local_experts * W}; "
                         f"build the config with world_size={W}")
    if x.ndim < 2 or x.shape[-1] != config.model_dim:
        raise ValueError(f"x must be [B, ..., model_dim={config.model_dim}] with a leading token-batch axis, "
                         f"got {tuple(x.shape)}")
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

    Returns:
      (y [B, ..., M_out], aux) where aux.l_aux is the mean of the per-device losses, aux.dispatch_count the sum
      over devices, aux.capacity the capacity every device used, aux.dropped_fraction over all assignments.
    """
    _check_global_shapes(params, x, config, placement, valid)
    config.gate(gate_index)
    degree = config.a2a_ffn_overlap_degree if a2a_ffn_overlap_degree is None else int(a2a_ffn_overlap_degree)
    if degree < 1:
        raise ValueError(f"a2a_ffn_overlap_degree must be >= 1, got {degree}")
    use_2dh = config.use_2dh if use_2dh is None else bool(use_2dh)
    expert_axes, token_axes = placement.expert_axes, placement.token_axes
    alignment = config.sharded_count * degree
    model_dim = config.model_dim

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
        plan, l_aux = route(
            params["gates"][gate_index], tokens, config, top_k=top_k, capacity_factor=capacity_factor,
            gate_index=gate_index, rng=rng, deterministic=deterministic, alignment=alignment, valid=mask,
            num_tokens_for_capacity=count_for_capacity, max_count_reduce=lambda c: lax.pmax(c, expert_axes))
        if plan.buffer_capacity is None:
            # dropless across devices: one rank sends at most S tokens to an expert (k choices are distinct)
            plan = plan.with_buffer_capacity(align_capacity(num_tokens, alignment))
        buf = dispatch.fast_encode(tokens, plan, config.is_postscore).astype(tokens.dtype)  # [E, C, M]
        num_experts, cap, _ = buf.shape
        chunk = cap // degree
        outputs = []
        for i in range(degree):  # independent chunks: chunk i's exchange can overlap chunk i-1's compute
            part = buf[:, i * chunk:(i + 1) * chunk]
            part = expert_all_to_all(part, expert_axes, use_2dh)  # [n, W*chunk, M]
            part = config.experts.batched(params["experts"], part)
            outputs.append(expert_all_to_all_reverse(part, expert_axes, use_2dh))  # [E, chunk, M_out]
        out = outputs[0] if degree == 1 else jnp.concatenate(outputs, axis=1)
        y = dispatch.fast_decode(out, plan, config.is_postscore)
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
        )
        return y, aux

    token_spec = placement.token_spec()
    specs = param_specs(params, placement)
    fn = _shard_map(local, placement.mesh,
                    in_specs=(specs, token_spec, None if valid is None else token_spec, None if rng is None else P()),
                    out_specs=(token_spec, P()))
    y, aux = fn(params, x, valid, rng)
    if config.result_func is not None:
        y = config.result_func(y)
    return y, aux
