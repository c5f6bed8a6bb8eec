"""`TokenGroup`: how one device's tokens relate to the other devices' when the MoE pipeline runs per device
inside `shard_map` (expert parallelism); the default, `LOCAL`, is one device with no collectives.

The routing needs three things from the group: a per-device noise key, the capacity agreed over the expert
group (`inequivalent_tokens`: from the largest valid token count; the dropless max count: the group's), and
the reductions that turn per-device routing statistics into the layer's aux.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["LOCAL", "TokenGroup"]


@dataclasses.dataclass(frozen=True)
class TokenGroup:
    """Attributes:
      token_axes: mesh axes the tokens are split over (empty: one device).
      expert_axes: the all_to_all group's axes (capacities are agreed over them).
      inequivalent_tokens: devices hold different numbers of valid tokens; agree the capacity from the largest.
    """

    token_axes: tuple[str, ...] = ()
    expert_axes: tuple[str, ...] = ()
    inequivalent_tokens: bool = False

    @property
    def is_local(self) -> bool:
        return not self.token_axes

    def fold_rng(self, rng: jax.Array | None) -> jax.Array | None:
        """A key of this device's own (the same noise as a Tutel rank drawing its own)."""
        if rng is None or self.is_local:
            return rng
        return jax.random.fold_in(rng, lax.axis_index(self.token_axes))

    def count_for_capacity(self, num_tokens: int, mask: jax.Array | None) -> jax.Array | None:
        """The token count the capacity is computed from: None (this device's S), or with inequivalent_tokens
        the largest valid count over the expert group."""
        if not self.inequivalent_tokens:
            return None
        local = num_tokens if mask is None else jnp.sum(mask.astype(jnp.int32))
        return lax.pmax(local, self.expert_axes) if self.expert_axes else local

    @property
    def max_count_reduce(self) -> Callable[[jax.Array], jax.Array] | None:
        """Reduces a per-device max count to the group's (dropless capacity), or None on one device."""
        if self.is_local:
            return None
        return lambda count: lax.pmax(count, self.expert_axes)

    def mean(self, value: jax.Array) -> jax.Array:
        return value if self.is_local else lax.pmean(value, self.token_axes)

    def sum(self, value: jax.Array) -> jax.Array:
        return value if self.is_local else lax.psum(value, self.token_axes)

    def max(self, value: jax.Array) -> jax.Array:
        return value if self.is_local else lax.pmax(value, self.token_axes)


LOCAL = TokenGroup()
