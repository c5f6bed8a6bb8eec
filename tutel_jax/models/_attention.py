"""The two attention kinds of the supported families, each with an optional static KV cache.

`gqa_attention`: grouped-query attention with the options of `DecoderSpec` (set per family, `models.families`):
q/k RMSNorm per head or over the whole projection, q/k/v or q/k/v/o biases, sinks, sliding windows, partial
rotary.
`mla_attention`: DeepSeek-V3 multi-head latent attention (q LoRA, compressed kv, rope/nope split). With a cache
it holds the compressed latent, shared by all heads (576 values per token for DeepSeek-V3, not 128 heads x 320),
and attends with kv_b_proj absorbed into the query and the output.
A layer's cache is {'k': [B, Hkv, L, Dk], 'v': [B, Hkv, L, Dv]} (heads-major) or None (no cache: L = T); MLA's is
{'k': the roped key part [B, 1, L, rope_dim], 'v': the normalized latent [B, 1, L, kv_lora_rank]}.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ..experts import head_linear
from ..native import attends_natively, decode_attention
from .. import quant
from ._layers import AttnContext, apply_rope, attend, linear, rms_norm, slot_index, write_cache
from ._param_layout import ABSORBED_K, ABSORBED_V
from ._spec import DecoderSpec

__all__ = ["gqa_attention", "mla_attention", "cache_dims"]


def cache_dims(spec: DecoderSpec) -> tuple[int, int, int]:
    """(kv heads, key dim, value dim) of one layer's cache."""
    if spec.mla is not None:  # the latent: one "head" of the roped key part and the normalized latent
        return 1, spec.mla.qk_rope_dim, spec.mla.kv_lora_rank
    return spec.num_kv_heads, spec.head_dim, spec.head_dim


def _with_cache(k, v, cache, ctx: AttnContext):
    """(keys, values, new cache) from the new k/v [B, T, H, D]: without a cache the keys and values are k/v
    themselves as [B, H, T, D]; with one they are written into it at ctx.index ([] or per row [B]) and the whole
    cache [B, H, L, D] is returned as the keys and values."""
    if cache is None:
        return jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), None
    ck, cv = write_cache(cache["k"], k, ctx.index), write_cache(cache["v"], v, ctx.index)
    return ck, cv, {"k": ck, "v": cv}


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array, rotary_dim: int | None) -> jax.Array:
    """RoPE on x [B, T, H, D]'s first `rotary_dim` dims (all when None); the rest passes through."""
    if rotary_dim is None:
        return apply_rope(x, cos, sin)
    return jnp.concatenate([apply_rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], axis=-1)


def gqa_attention(p: Mapping[str, Any], x: jax.Array, cos: jax.Array, sin: jax.Array, ctx: AttnContext,
                  spec: DecoderSpec, window: int | None, cache: dict | None = None):
    """x [B, T, M] -> ([B, T, M], new cache); window: the layer's sliding window (None: full).
    p (see `param_layout`; linears [out, in]): qkv_proj (fused) [+ qkv_bias], or q/k/v_proj [+ q/k/v_bias]
    (quantized);
    o_proj [+ o_bias]; q_norm / k_norm [D] (spec.qk_norm 'head') or [Hq*D] / [Hkv*D] ('projection'); sinks [Hq].
    A decode step that `native.attends_natively` gives to the kernel for spec.attention_impl (on CPU by default:
    one token, a float32 / bfloat16 cache) writes the cache and attends in one native call, with `write_cache` +
    `attend`'s semantics."""
    B, T, _ = x.shape
    D, H, Hkv = spec.head_dim, spec.num_heads, spec.num_kv_heads
    if "qkv_proj" in p:
        qkv = linear(x, p["qkv_proj"], p.get("qkv_bias"), spec.dense_impl)
        q, k, v = jnp.split(qkv, [H * D, (H + Hkv) * D], axis=-1)
    else:
        q, k, v = (linear(x, p[f"{n}_proj"], p.get(f"{n}_bias"), spec.dense_impl) for n in "qkv")
    if spec.qk_norm == "projection":  # OLMoE: over the whole q / k projection, before the split into heads
        q, k = rms_norm(q, p["q_norm"], spec.eps), rms_norm(k, p["k_norm"], spec.eps)
    q, k, v = q.reshape(B, T, H, D), k.reshape(B, T, Hkv, D), v.reshape(B, T, Hkv, D)
    if spec.qk_norm == "head":
        q, k = rms_norm(q, p["q_norm"], spec.eps), rms_norm(k, p["k_norm"], spec.eps)
    q, k = _rope(q, cos, sin, spec.rotary_dim), _rope(k, cos, sin, spec.rotary_dim)
    if cache is not None and attends_natively(q, cache["k"], spec.attention_impl):
        # a decode step on CPU: the cache update and the attention over it in one native call, in place
        o, ck, cv = decode_attention(q, k, v, cache["k"], cache["v"], slot_index(ctx.index), ctx.key_valid,
                                     D ** -0.5, window=window, sinks=p.get("sinks"))
        o, cache = o.astype(cache["v"].dtype), {"k": ck, "v": cv}
    else:
        k, v, cache = _with_cache(k, v, cache, ctx)
        o = attend(q, k, v, ctx, D ** -0.5, window=window, sinks=p.get("sinks"))
    return linear(o.reshape(B, T, -1), p["o_proj"], p.get("o_bias"), spec.dense_impl), cache


def _absorbed(p: Mapping[str, Any], heads: int, nope: int, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """kv_b_proj's absorbed halves as `dtype` stacks [out, in] per head: W_UK^T [H, kv_lora, nope] and W_UV [H, v,
    kv_lora]; those the model holds (`param_layout.absorbed_mla_weights`), else from kv_b_proj [H*(nope+v),
    kv_lora], float or a packed container (dequantized at every call: kv_lora x H*(nope+v) values a layer)."""
    if ABSORBED_K in p:
        return p[ABSORBED_K].astype(dtype), p[ABSORBED_V].astype(dtype)
    w = p["kv_b_proj"]
    w = quant.dequantize(w, dtype) if quant.is_quantized(w) else jnp.asarray(w, dtype)
    w = w.reshape(heads, -1, w.shape[-1])  # [H, nope + v, kv_lora]
    return jnp.swapaxes(w[:, :nope], 1, 2), w[:, nope:]


def mla_attention(p: Mapping[str, Any], x: jax.Array, cos: jax.Array, sin: jax.Array, ctx: AttnContext,
                  spec: DecoderSpec, window: int | None = None, cache: dict | None = None):
    """DeepSeek-V3 MLA, x [B, T, M] -> ([B, T, M], new cache). cos/sin [B, T, rope_dim]; window: unused (no
    sliding window in MLA; the signature of `gqa_attention`).

    Without a cache the keys and values are decompressed per head (kv_b_proj), as in the HF model. With one, the
    cache holds the latent c [kv_lora] and the roped key k_r [rope] of each slot, and kv_b_proj's halves are
    absorbed: q_nope . (W_UK c) = (W_UK^T q_nope) . c and the output W_UV (sum_l p_l c_l), i.e. multi-query
    attention with one key [c, k_r] and one value c per slot (the same scores and outputs; a decode step reads
    576 cached values per slot instead of H x 320)."""
    m = spec.mla
    B, T, _ = x.shape
    H = spec.num_heads
    if "q_a_proj" in p:
        q = linear(rms_norm(linear(x, p["q_a_proj"], impl=spec.dense_impl), p["q_a_layernorm"], spec.eps),
                   p["q_b_proj"], impl=spec.dense_impl)
    else:
        q = linear(x, p["q_proj"], impl=spec.dense_impl)
    q = q.reshape(B, T, H, m.qk_nope_dim + m.qk_rope_dim)
    q_pass, q_rot = q[..., :m.qk_nope_dim], q[..., m.qk_nope_dim:]
    ckv = linear(x, p["kv_a_proj_with_mqa"], impl=spec.dense_impl)  # [B, T, kv_lora + rope]
    latent = rms_norm(ckv[..., :m.kv_lora_rank], p["kv_a_layernorm"], spec.eps)  # [B, T, kv_lora]
    q_rot = apply_rope(q_rot, cos, sin, interleaved=m.rope_interleave)
    k_rot = apply_rope(ckv[:, :, None, m.kv_lora_rank:], cos, sin, interleaved=m.rope_interleave)  # [B, T, 1, rope]
    if cache is None:
        kv = linear(latent, p["kv_b_proj"], impl=spec.dense_impl).reshape(B, T, H, m.qk_nope_dim + m.v_dim)
        k_pass, v = kv[..., :m.qk_nope_dim], kv[..., m.qk_nope_dim:]
        q = jnp.concatenate([q_pass, q_rot], axis=-1)
        k = jnp.concatenate([k_pass, jnp.broadcast_to(k_rot, (B, T, H, m.qk_rope_dim))], axis=-1)
        k, v, _ = _with_cache(k, v, None, ctx)
        o = attend(q, k, v, ctx, m.softmax_scale)
    else:
        w_k, w_v = _absorbed(p, H, m.qk_nope_dim, x.dtype)  # [H, kv_lora, nope], [H, v, kv_lora]
        ck, cv, cache = _with_cache(k_rot, latent[:, :, None], cache, ctx)  # [B, 1, L, rope], [B, 1, L, kv_lora]
        # in the model dtype, as the per-head keys and queries of the decompressed form are
        q_lat = head_linear(q_pass.astype(x.dtype), w_k, spec.dense_impl)  # [B, T, H, kv_lora]
        q = jnp.concatenate([q_lat.astype(q_rot.dtype), q_rot], axis=-1)  # [B, T, H, kv_lora + rope]
        o_lat = attend(q, jnp.concatenate([cv, ck], axis=-1), cv, ctx, m.softmax_scale)  # [B, T, H, kv_lora]
        o = head_linear(o_lat.astype(x.dtype), w_v, spec.dense_impl)  # [B, T, H, v]
    return linear(o.reshape(B, T, -1), p["o_proj"], impl=spec.dense_impl), cache
