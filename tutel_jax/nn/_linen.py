"""Flax Linen adapter for the MoE layer.

`MoELinen` keeps the whole MoE parameter pytree under one Linen param named 'moe' (the functional core's layout,
so `tutel_format` converts it to and from Tutel state dicts). Each call sows the aux loss and routing statistics
into the 'intermediates' collection (`l_aux`, `dispatch_count`, `capacity`, `dropped_fraction`) and returns
only the output, so it drops into any Linen model; read the loss with `mutable=['intermediates']`.
Gate noise (training, `deterministic=False`) draws from the 'gate_noise' RNG stream.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..layer import make_config, init_params, moe_apply
from ..routing import as_gate

__all__ = ["MoELinen"]


class MoELinen(nn.Module):
    """Tutel's MoE layer as a Linen module; `moe_kwargs` holds further `moe_layer` options
    (is_postscore, batch_prioritized_routing, normalize_gate, is_gshard_loss, a2a_ffn_overlap_degree, ...)."""

    gate_type: Any
    model_dim: int
    experts: Any
    moe_kwargs: Any = None
    dtype: Any = jnp.float32

    def config(self):
        return make_config(self.gate_type, self.model_dim, self.experts, dtype=self.dtype, **dict(self.moe_kwargs or {}))

    @nn.compact
    def __call__(self, x: jax.Array, top_k: int | None = None, capacity_factor: float | None = None,
                 gate_index: int = 0, deterministic: bool = True) -> jax.Array:
        config = self.config()
        params = self.param("moe", lambda key: init_params(config, key))
        gate = config.gate(gate_index)
        rng = self.make_rng("gate_noise") if (not deterministic and as_gate(gate).needs_rng) else None
        y, aux = moe_apply(params, x, config, top_k=top_k, capacity_factor=capacity_factor, gate_index=gate_index,
                           rng=rng, deterministic=deterministic)
        for name in ("l_aux", "dispatch_count", "capacity", "dropped_fraction"):
            self.sow("intermediates", name, getattr(aux, name))
        return y
