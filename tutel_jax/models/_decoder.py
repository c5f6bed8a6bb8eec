"""An HF MoE decoder as a pure function over a parameter pytree: embed, one pre-norm block per layer, head.

    logits, cache = forward(params, input_ids [B, T], ctx, cache, spec=spec, moe_configs=configs)

MoE layers run through the tutel-jax MoE block (`moe_apply`; dropless: each gate's default `capacity_factor=0.0`).
Everything that varies between layers is an argument of `decoder_layer`, so `layer_programs` compiles one
program per kind of block of layers from the same pieces.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..layer import moe_apply, route
from ..parallel import moe_apply_expert_sliced
from ._attention import gqa_attention, mla_attention
from ._layers import AttnContext, rms_norm, rope_cos_sin, swiglu_mlp, unembed
from ._spec import DecoderSpec

__all__ = ["forward", "decoder_layer", "embed", "head", "context_from_mask"]


def context_from_mask(attention_mask: jax.Array) -> AttnContext:
    """No-cache context of a [B, T] 0/1 mask (left or right padding): positions = cumsum(mask) - 1."""
    mask = attention_mask.astype(bool)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0).astype(jnp.int32)
    return AttnContext(positions, jnp.zeros((), jnp.int32), mask)


def embed(params: dict, input_ids: jax.Array, ctx: AttnContext, spec: DecoderSpec):
    """The decoder's input: (x [B, T, M] the token embeddings, cos / sin [B, T, rope_dim] of ctx.positions)."""
    x = jnp.take(params["embed"], input_ids, axis=0)
    cos, sin = rope_cos_sin(ctx.positions, np.asarray(spec.inv_freq, np.float32), spec.attention_factor)
    return x, cos, sin


def decoder_layer(lp: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, ctx: AttnContext,
                  cache: dict | None = None, *, spec: DecoderSpec, window: int | None, moe_config: Any,
                  expert_mesh: tuple[Any, str] | None = None,
                  moe_fn: Callable[[dict, jax.Array], tuple[jax.Array, Any]] | None = None):
    """One pre-norm block, x [B, T, M] -> (x + attn(norm(x)) + ffn(norm(.)), new cache, h [B, T, M] the FFN
    input). Everything that varies between layers is an argument: window (the sliding window, None: full) and
    moe_config (None: a dense SwiGLU MLP), so layers of one kind share one compiled program (`layer_programs`).
    moe_fn(moe_params, h) -> (y, aux) replaces the MoE block (see `forward`)."""
    attn = mla_attention if spec.mla is not None else gqa_attention
    a, cache = attn(lp["attn"], rms_norm(x, lp["input_layernorm"], spec.eps), cos, sin, ctx, spec, window, cache)
    x = x + a
    h = rms_norm(x, lp["post_attention_layernorm"], spec.eps)
    if moe_config is None:
        y = swiglu_mlp(lp["mlp"], h, spec.dense_impl)
    elif moe_fn is not None:
        y, _ = moe_fn(lp["moe"], h)
    elif expert_mesh is None:
        y, _ = moe_apply(lp["moe"], h, moe_config, valid=ctx.query_valid)  # dropless: the gate default
    else:
        y, _ = moe_apply_expert_sliced(lp["moe"], h, moe_config, *expert_mesh)
    return x + y, cache, h


def head(params: dict, x: jax.Array, spec: DecoderSpec, logits_at: jax.Array | None = None) -> jax.Array:
    """float32 logits of the last hidden states x [B, T, M]: [B, T, V], or [B, 1, V] at logits_at [B]."""
    if logits_at is not None:
        x = jnp.take_along_axis(x, jnp.asarray(logits_at, jnp.int32).reshape(-1, 1, 1), axis=1)  # [B, 1, M]
    x = rms_norm(x, params["norm"], spec.eps)
    # lm_head [V, M] as stored (tied: the embedding)
    logits = unembed(x, params["lm_head"] if "lm_head" in params else params["embed"], spec.dense_impl)
    return logits.astype(jnp.float32)


def forward(params: dict, input_ids: jax.Array, ctx: AttnContext, cache: list | None = None, *,
            spec: DecoderSpec, moe_configs: tuple, return_router: bool = False,
            expert_mesh: tuple[Any, str] | None = None,
            moe_fn: Callable[[int, dict, jax.Array], tuple[jax.Array, Any]] | None = None,
            logits_at: jax.Array | None = None):
    """Logits of the T new tokens (one traced program: embed, every `decoder_layer`, head).

    Args:
      params: from `hf_tables.load_params`.
      input_ids: [B, T] int.
      ctx: positions [B, T], cache index, key_valid [B, L] (L = T without a cache).
      spec, moe_configs: static model description.
      cache: per-layer {'k', 'v'} [B, Hkv, L, D] or None.
      return_router: also return the last MoE layer's (ids [B, T, k], weights [B, T, k]).
      expert_mesh: (mesh, expert_axis) when the routed experts are split over that mesh axis: each MoE layer
        runs `parallel.expert_sliced` (every device its own experts on all tokens, one all-reduce).
      moe_fn: `moe_fn(i, moe_params, h [B, T, M]) -> (y [B, T, M], aux)` runs MoE layer i instead of
        `moe_apply` / expert_mesh (e.g. a trainer's expert-parallel layer; forward drops aux, moe_fn may record it).
      logits_at: [B] int, the one new token per row whose logits are wanted (a prefill samples from one
        position: the lm_head then runs on B rows instead of B x T).
    Returns:
      (logits float32 [B, T, V] (with logits_at: [B, 1, V]), new cache or None[, router]).
    """
    x, cos, sin = embed(params, input_ids, ctx, spec)
    new_cache, router = [], None
    for i, lp in enumerate(params["layers"]):
        layer_moe = None if moe_fn is None else functools.partial(moe_fn, i)
        x, c, h = decoder_layer(lp, x, cos, sin, ctx, None if cache is None else cache[i], spec=spec,
                                window=spec.windows[i], moe_config=moe_configs[i], expert_mesh=expert_mesh,
                                moe_fn=layer_moe)
        new_cache.append(c)
        if return_router and i == spec.last_moe_layer:
            plan, _ = route(lp["moe"]["gates"][0], h.reshape(-1, h.shape[-1]).astype(moe_configs[i].dtype),
                            moe_configs[i])
            shape = h.shape[:2] + (-1,)
            router = (plan.expert_ids.T.reshape(shape), plan.gates.T.reshape(shape))
    out = (head(params, x, spec, logits_at), None if cache is None else new_cache)
    return out + (router,) if return_router else out
