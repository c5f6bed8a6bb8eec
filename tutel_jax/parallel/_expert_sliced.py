"""Expert slicing: the MoE layer over a mesh whose devices all see the same tokens and each hold E / W experts.

The serving layout (few tokens, big experts): the tokens [S, M] are replicated over the mesh, the routed experts'
parameters are split along their first axis over `expert_axis` (W devices, n = E / W each). Every device routes
all S tokens (the gate is small and replicated), keeps the assignments that chose one of its own n experts
(`local_plan`), runs only those through its experts (any dropless implementation, or the capacity buffer
[n, C, M]) and combines them into a partial output [S, M_out]; one `psum` over the expert axis sums the W
partial outputs. No all_to_all and no expert weight ever leaves its device: each device reads only its own
1/W of the expert weights, for one all-reduce of [S, M_out] per layer.

Results equal `moe_apply` on one device up to the order of the final sum over devices. Differentiable
(shard_map's transpose sums the replicated gate's gradient over devices).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from ..layer import MoEConfig, MoEAux, moe_apply, run_routed_experts
from ..routing import RoutingPlan
from ..validation import check_input
from ..core import varying_like
from ._expert_parallel import shard_map

__all__ = ["local_plan", "moe_apply_expert_sliced", "param_specs"]

#: the slot of an assignment to another device's expert: beyond any capacity and any row of the grouped layout
_ELSEWHERE = 2 ** 30


def local_plan(plan: RoutingPlan, first_expert: jax.Array, num_local: int) -> RoutingPlan:
    """The plan restricted to experts [first_expert, first_expert + num_local), renumbered from 0.

    Assignments to other experts keep weight 0 and an out-of-range slot (dropped by encode, zero in decode);
    dispatch_count becomes the local experts' [num_local] counts. The capacity is unchanged (the global one:
    every device lays out the same buffer size)."""
    ids = plan.expert_ids - first_expert
    mine = (ids >= 0) & (ids < num_local)
    return dataclasses.replace(
        plan,
        expert_ids=jnp.where(mine, ids, 0).astype(jnp.int32),
        locations=jnp.where(mine, plan.locations, _ELSEWHERE).astype(jnp.int32),
        gates=jnp.where(mine, plan.gates, 0).astype(plan.gates.dtype),
        dispatch_count=lax.dynamic_slice_in_dim(plan.dispatch_count, first_expert, num_local),
        num_experts=num_local,
    )


def param_specs(params: dict, expert_axis: str) -> dict:
    """PartitionSpecs of a layer's parameters: every leaf under 'experts' split on its first axis, the rest
    (gates, shared experts) replicated."""
    return {name: jax.tree_util.tree_map(lambda _: P(expert_axis) if name == "experts" else P(), value)
            for name, value in params.items()}


def moe_apply_expert_sliced(params: dict, x: jax.Array, config: MoEConfig, mesh: Mesh, expert_axis: str = "expert",
                            **kwargs: Any) -> tuple[jax.Array, MoEAux]:
    """`moe_apply` with the routed experts split over `mesh`'s `expert_axis` and the tokens replicated.

    Args:
      params: the layer's parameters; the 'experts' leaves [E, ...] sharded (or to be sharded) along their first
        axis over `expert_axis`, everything else replicated.
      x: [..., M] tokens, replicated over the mesh.
      config: the layer's MoEConfig; E must be a multiple of the axis size.
      kwargs: moe_apply's per-call options (top_k, capacity_factor, gate_index, rng, deterministic, ...).
    Returns:
      (y, aux) as `moe_apply`, replicated.
    """
    check_input(x, config.model_dim)  # also checked by moe_apply, but here before tracing the mesh program
    if expert_axis not in mesh.axis_names:
        raise ValueError(f"expert_axis {expert_axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
    world = mesh.shape[expert_axis]
    num_experts = config.num_global_experts
    if num_experts % world:
        raise ValueError(f"{num_experts} experts cannot be split over mesh axis {expert_axis!r} of size {world}")
    num_local = num_experts // world

    def run_local(expert_params, tokens, plan, cfg):
        first = lax.axis_index(expert_axis) * num_local
        mine = local_plan(plan, first, num_local)
        # the replicated tokens meet per-device slots: cast them here, so that the transpose of the cast (a
        # psum of the tokens' gradient) sits outside the dispatch ops' custom VJPs
        tokens = varying_like(tokens, mine.gates)
        return lax.psum(run_routed_experts(expert_params, tokens, mine, cfg, load_experts=num_experts), expert_axis)

    rng = kwargs.pop("rng", None)

    def body(params, x, rng):
        return moe_apply(params, x, config, rng=rng, run_experts=run_local, **kwargs)

    fn = shard_map(body, mesh, in_specs=(param_specs(params, expert_axis), P(), P()), out_specs=(P(), P()))
    return fn(params, x, rng)
