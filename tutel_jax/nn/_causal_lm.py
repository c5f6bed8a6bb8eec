"""Thin Flax NNX wrapper of a CausalLM: parameters as `nnx.Param` (DeepSeek's `e_score_correction_bias` as the
MoE module's non-trainable `RouterState`), forward = the pure `decoder.forward`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ._nnx import _unbox, _wrap_params
from ..models import CausalLM, context_from_mask, forward

__all__ = ["NNXCausalLM"]


class NNXCausalLM(nnx.Module):
    """`NNXCausalLM(model)(input_ids [B, T], attention_mask=None) -> float32 logits [B, T, V]`; train it with
    `nnx.Optimizer(m, tx, wrt=nnx.Param)`. `spec` / `moe_configs` stay static."""

    def __init__(self, model: CausalLM):
        self.spec = model.spec
        self.moe_configs = model.moe_configs
        self.expert_mesh = model.expert_mesh
        self.params = nnx.data(_wrap_params(model.params))

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        input_ids = jnp.asarray(input_ids, jnp.int32)
        mask = jnp.ones(input_ids.shape, bool) if attention_mask is None else jnp.asarray(attention_mask)
        logits, _ = forward(_unbox(self.params), input_ids, context_from_mask(mask), spec=self.spec,
                            moe_configs=self.moe_configs, expert_mesh=self.expert_mesh)
        return logits
