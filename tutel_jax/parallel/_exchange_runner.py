"""The expert-parallel experts runner of `layer.moe_pipeline`: exchange -> local experts -> exchange.

Inside `shard_map`, on each device of the expert axes: encode the device's tokens into [E, C, M] slots,
all_to_all them so each device holds its own experts' slots from every device ([n, W*C, M]), run its experts
(`experts.batched`), all_to_all back and decode. With overlap degree d the capacity axis is cut into d
independent chunks (one chunk's exchange can overlap another's expert matmuls). Sharded experts (s devices per
expert, Tutel's adaptive r): each expert's capacity is split over s/r replicas and, inside a replica, the r
devices hold 1/r of its hidden units (their partial outputs summed after the reverse exchange); r = 0 gathers
every expert on every device and runs them locally (no exchange). Dropless plans: the padded all_to_all at the
smallest static bucket >= the group's max count, or a ragged exchange (`parallel.exchanges`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from .. import routing
from ..experts import bucket_capacities, run_bucketed
from ..layer import MoEConfig, run_routed_experts
from ..routing import RoutingPlan, align_capacity
from ._all_to_all import expert_all_to_all, expert_all_to_all_reverse
from ._ragged_dropless import ragged_dropless_experts

__all__ = ["ExchangeRunner", "SHARDED_EXPERT_AXES"]

SHARDED_EXPERT_AXES = ("_moe_e", "_moe_q", "_moe_t")  # (expert, capacity replica, tensor-parallel)


@dataclasses.dataclass(frozen=True)
class ExchangeRunner:
    """`runner(expert_params, tokens [S_local, M], plan, config) -> [S_local, M_out]` on one device.

    Attributes:
      expert_axes: the all_to_all group's mesh axes (SHARDED_EXPERT_AXES for sharded experts).
      use_2dh: hierarchical all_to_all over two expert axes.
      degree: overlap chunks of the capacity axis.
      sharded_count, adaptive_r: s and Tutel's r (s = 1: whole experts).
      hidden_axes: per expert-parameter leaf, its hidden-unit axis (sharded experts), else None.
      collective: a ragged exchange for dropless plans (`parallel.exchanges`), or None for the padded one.
      recv_capacity: rows each device can receive in the ragged exchange.
    """

    expert_axes: tuple[str, ...]
    use_2dh: bool
    degree: int
    sharded_count: int
    adaptive_r: int
    hidden_axes: Any = None
    collective: Callable | None = None
    recv_capacity: int | None = None

    def __call__(self, expert_params: Any, tokens: jax.Array, plan: RoutingPlan, config: MoEConfig) -> jax.Array:
        if self.adaptive_r == 0:  # data parallel: every expert here, no exchange
            return run_routed_experts(self._gather_all_experts(expert_params), tokens, plan, config)
        if self.sharded_count > 1:
            expert_params = self._replica_params(expert_params)
        if plan.buffer_capacity is not None:
            return self._run_at(expert_params, tokens, plan, config)
        # dropless across devices, padded all_to_all: the smallest of a few static capacities >= the group's max
        # count (plan.capacity, the same on every device, so every device takes the same branch). Bound: a rank
        # sends at most S_local assignments to one expert (a token's k experts are distinct), so the top
        # bucket, S_local, always fits: nothing is ever dropped.
        num_tokens = tokens.shape[0]
        alignment = self.sharded_count * self.degree
        top = align_capacity(num_tokens, alignment)
        caps = bucket_capacities(num_tokens, config.num_global_experts, plan.top_k, alignment=alignment,
                                          max_capacity=top)
        caps = caps + ((top,) if caps[-1] < top else ())

        def padded():
            return run_bucketed(plan, caps, lambda p: self._run_at(expert_params, tokens, p, config),
                                         need=plan.capacity)

        if self.collective is None:
            return padded()
        return ragged_dropless_experts(
            tokens, plan, expert_params, config.experts, self.expert_axes, is_postscore=config.is_postscore,
            recv_capacity=self.recv_capacity, fallback=padded, exchange=self.collective).astype(tokens.dtype)

    def _run_at(self, expert_params: Any, tokens: jax.Array, plan: RoutingPlan, config: MoEConfig) -> jax.Array:
        """The capacity path through the exchange, in `degree` independent chunks of the capacity axis."""
        buf = routing.fast_encode(tokens, plan, config.is_postscore, config.kernel_backend)
        buf = buf.astype(tokens.dtype)  # [E, C, M]
        chunk = buf.shape[1] // self.degree
        # independent chunks: chunk i's exchange can overlap chunk i-1's expert compute
        outputs = [self._exchange_and_compute(buf[:, i * chunk:(i + 1) * chunk], expert_params, config)
                   for i in range(self.degree)]
        out = outputs[0] if self.degree == 1 else jnp.concatenate(outputs, axis=1)
        return routing.fast_decode(out, plan, config.is_postscore, config.kernel_backend)

    def _exchange_and_compute(self, part: jax.Array, expert_params: Any, config: MoEConfig) -> jax.Array:
        """[E, c, M] slots -> [E, c, M_out] expert outputs, through the expert devices."""
        s, r = self.sharded_count, self.adaptive_r
        if s == 1:
            part = expert_all_to_all(part, self.expert_axes, self.use_2dh)  # [n, W*c, M]
            part = config.experts.batched(expert_params, part)
            return expert_all_to_all_reverse(part, self.expert_axes, self.use_2dh)
        num_experts, c, dim = part.shape
        replicas, tp = s // r, r
        piece = part.reshape(num_experts, replicas, 1, c // replicas, dim)
        piece = jnp.broadcast_to(piece, (num_experts, replicas, tp, c // replicas, dim))
        piece = piece.reshape(num_experts * replicas * tp, c // replicas, dim)  # one row block per device
        piece = expert_all_to_all(piece, self.expert_axes)  # [1, W*c/replicas, M]
        piece = config.experts.batched(expert_params, piece)
        piece = expert_all_to_all_reverse(piece, self.expert_axes)  # [W, c/replicas, M_out]
        piece = piece.reshape(num_experts, replicas, tp, c // replicas, piece.shape[-1]).sum(axis=2)
        return piece.reshape(num_experts, c, piece.shape[-1])

    def _gather_all_experts(self, local_params: Any) -> Any:
        """r = 0: every expert's full weights on every device."""
        s = self.sharded_count

        def gather(leaf, axis=None):
            if s > 1 and axis is not None:
                leaf = lax.all_gather(leaf, SHARDED_EXPERT_AXES[1:], axis=axis, tiled=True)
            return lax.all_gather(leaf, self.expert_axes[:1] if s > 1 else self.expert_axes, axis=0, tiled=True)

        if s == 1:
            return jax.tree.map(gather, local_params)
        return jax.tree.map(gather, local_params, self.hidden_axes)

    def _replica_params(self, local_params: Any) -> Any:
        """r >= 1, sharded experts: this device's 1/r of its expert's hidden units; output biases on t = 0 only."""
        first_tp = (lax.axis_index(SHARDED_EXPERT_AXES[2]) == 0)

        def take(leaf, axis):
            if axis is None:
                return leaf * first_tp.astype(leaf.dtype)
            return lax.all_gather(leaf, SHARDED_EXPERT_AXES[1], axis=axis, tiled=True)

        return jax.tree.map(take, local_params, self.hidden_axes)
