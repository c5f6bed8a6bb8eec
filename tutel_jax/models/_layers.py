"""Building blocks of the HF decoder families: RMSNorm, RoPE (default / YaRN, half-split / interleaved),
masked attention with an optional static KV cache and attention sinks, dense SwiGLU MLP.

Linear weights are [out, in] as on disk, float or quantized containers (`linear(x, w, b)` computes
`x @ w.T + b`; see `param_layout`), and so are the lm_head and the embedding (`unembed`).
Shapes: B batch, T new tokens, L key slots (T without a cache, the static cache length with one),
Hq / Hkv query / key-value heads, D head dim.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import quant
from ..experts import DENSE_IMPLS, check_dense_impl, linear, matmul_out_in, native_activations, xla_weight
from ..native import dense

__all__ = ["DENSE_IMPLS", "check_dense_impl", "rms_norm", "linear", "unembed", "swiglu_mlp", "rope_inv_freq", "rope_cos_sin", "apply_rope", "AttnContext",
           "attend", "slot_index", "write_cache"]


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """HF RMSNorm: float32 `x * rsqrt(mean(x^2) + eps)`, cast back, times w. x [..., D], w [D]."""
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return w * h.astype(x.dtype)


def unembed(x: jax.Array, table: jax.Array, impl: str = "auto") -> jax.Array:
    """Logits x [..., M] @ table[V, M].T -> [..., V] in x's dtype: the lm_head (or a tied embedding) as the
    checkpoint stores it, [out, in] rows (read contiguously, one dot product per vocabulary entry). impl as in
    `linear`."""
    activations = native_activations(x, table, impl)
    if activations is not None:
        return dense(x, table, activations=activations).astype(x.dtype)
    table = xla_weight(table)
    if quant.is_quantized(table):
        return quant.dense(x, table)
    return matmul_out_in(x, table.astype(x.dtype))


def swiglu_mlp(p: Mapping[str, jax.Array], x: jax.Array, impl: str = "auto") -> jax.Array:
    """Dense HF MLP `down(silu(gate(x)) * up(x))`; p holds gate_proj / up_proj / down_proj [out, in]."""
    return linear(jax.nn.silu(linear(x, p["gate_proj"], impl=impl)) * linear(x, p["up_proj"], impl=impl),
                  p["down_proj"], impl=impl)


def rope_inv_freq(rope: Mapping[str, Any], dim: int, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """(inv_freq [dim/2] float32, attention_factor) of an HF `rope_parameters` dict ('default' or 'yarn')."""
    base = float(rope.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    exps = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.power(np.float32(base), exps, dtype=np.float32)
    if rope_type == "default":
        return (np.float32(1.0) / pos_freqs).astype(np.float32), 1.0
    if rope_type != "yarn":
        raise ValueError(f"unsupported rope_type {rope_type!r} (supported: 'default', 'yarn')")
    factor = float(rope["factor"])
    original = rope.get("original_max_position_embeddings")
    if original:
        factor = max_position_embeddings / float(original)  # HF: the ratio, as DeepSeek-V3 sets it
    else:
        original = max_position_embeddings

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1)

    def correction_dim(rot):
        return dim * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = 1 - ramp
    inv = (np.float32(1.0) / (np.float32(factor) * pos_freqs)) * (1 - extrapolation) \
        + (np.float32(1.0) / pos_freqs) * extrapolation
    return inv.astype(np.float32), float(attention_factor)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray, attention_factor: float) -> tuple[jax.Array, jax.Array]:
    """positions [B, T] -> cos, sin [B, T, D] (HF: cat(freqs, freqs), times the attention factor), float32."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * attention_factor, jnp.sin(emb) * attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool = False) -> jax.Array:
    """x [B, T, H, D] rotated by cos/sin [B, T, D] with HF's rotate_half; `interleaved` first de-interleaves
    the pairs (x0, x1), (x2, x3), ... into halves (DeepSeek's rope_interleave)."""
    if interleaved:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rot * sin


class AttnContext(NamedTuple):
    """Where the T new tokens sit. positions [B, T] (RoPE); index: cache slot of the first new token, either
    [] int32 shared by all rows (0 without a cache) or [B] int32, each row's own slot (continuous batching), or
    None: slot 0 of a cache holding nothing before them (a prefill), which attention uses statically (it reads
    only the first T slots, a block of queries only the keys it can see: `attend`);
    key_valid [B, L] bool: slots holding real tokens (padding False); query_valid [B, T] bool or None: which of
    the new tokens are real (None: all). MoE layers route only the real ones (padding takes no expert slot, and
    the native kernel reads no weights for it); the other outputs at padding are computed but never seen."""

    positions: jax.Array
    index: jax.Array
    key_valid: jax.Array
    query_valid: jax.Array | None = None


def slot_index(index: jax.Array | None) -> jax.Array:
    """`AttnContext.index` as an array: None (a prefill from slot 0) is slot 0."""
    return jnp.zeros((), jnp.int32) if index is None else index


def write_cache(cache: jax.Array, new: jax.Array, index: jax.Array | None) -> jax.Array:
    """cache [B, H, L, D] with new [B, T, H, D] written at slots index .. index+T-1 (index [] or [B]: per row;
    None: 0).

    The cache is heads-major so that attention reads each head's keys contiguously (no per-step transpose).
    As with `dynamic_update_slice`, a start index is clamped so that the T slots fit in L."""
    new = jnp.swapaxes(new, 1, 2).astype(cache.dtype)  # [B, H, T, D]
    index = slot_index(index)
    if jnp.ndim(index) == 0:
        return jax.lax.dynamic_update_slice(cache, new, (0, 0, index, 0))

    def row_update(c, n, i):  # c [H, L, D], n [H, T, D], i []
        return jax.lax.dynamic_update_slice(c, n, (0, i, 0))

    return jax.vmap(row_update)(cache, new, index.astype(jnp.int32))


def _window_slots(a: jax.Array, start: jax.Array, window: int) -> jax.Array:
    """a [B, H, L, D] -> [B, H, window, D]: slots start .. start + window - 1 (start [] or [B]: per row)."""
    if jnp.ndim(start) == 0:
        return jax.lax.dynamic_slice_in_dim(a, start, window, axis=2)
    return jax.vmap(lambda row, s: jax.lax.dynamic_slice_in_dim(row, s, window, axis=1))(a, start)


def _masked_softmax(s: jax.Array, allowed: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """Softmax over the keys of float32 scores s [B, G, R, T, L] where allowed [B, T, L] (the others score
    float32's lowest value); sinks [G * R]: a per-head logit joining the softmax and then dropped (GPT-OSS)."""
    s = jnp.where(allowed[:, None, None], s, jnp.finfo(jnp.float32).min)
    if sinks is None:
        return jax.nn.softmax(s, axis=-1)
    G, R = s.shape[1], s.shape[2]
    sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, G, R, 1, 1), s.shape[:-1] + (1,))
    return jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]


#: a prefill's queries go in at most this many blocks (each block attends over the keys it can see: about
#: (n + 1) / 2n of the causal square's scores for n blocks), of at least PREFILL_MIN_BLOCK queries
PREFILL_BLOCKS, PREFILL_MIN_BLOCK = 4, 128


def _prefill_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_valid: jax.Array, scale: float,
                       window: int | None, sinks: jax.Array | None) -> jax.Array:
    """`attend` for T new tokens at slots 0 .. T-1 of a cache holding nothing before them: q [B, T, Hq, D], k
    [B, Hkv, L, D], v [B, Hkv, L, Dv] (L >= T; slots from T on are never visible), key_valid [B, >= T] ->
    [B, T, Hq, Dv].

    The queries go in blocks of consecutive tokens; block [t0, t1) attends over slots [lo, t1) only (lo = 0, or
    t0 - window + 1 with a sliding window), the slots a query of the block can see, so the scores of the
    causal square's masked half (and the cache's slots past T) are never computed. Within a block the GQA
    group's R query heads and the block's tokens are one matmul's rows ([R * Tb, D] against [Lb, D]), scores
    float32 whatever the dtype; the masking and softmax are `attend`'s (`_masked_softmax`)."""
    B, T, Hq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    R = Hq // Hkv
    qg = jnp.moveaxis(q.reshape(B, T, Hkv, R, D), 1, 3)  # [B, G, R, T, D]
    size = max(PREFILL_MIN_BLOCK, -(-T // PREFILL_BLOCKS))
    outs = []
    for t0 in range(0, T, size):
        t1 = min(t0 + size, T)
        lo = 0 if window is None else max(0, t0 - window + 1)
        n, m = t1 - t0, t1 - lo
        qb = qg[:, :, :, t0:t1].reshape(B, Hkv, R * n, D)
        s = jnp.einsum("bgmd,bgld->bgml", qb, k[:, :, lo:t1], preferred_element_type=jnp.float32) * scale
        q_slot, k_slot = np.arange(t0, t1)[:, None], np.arange(lo, t1)[None, :]
        allowed = k_slot <= q_slot
        if window is not None:
            allowed &= q_slot - k_slot < window
        p = _masked_softmax(s.reshape(B, Hkv, R, n, m), jnp.asarray(allowed)[None] & key_valid[:, None, lo:t1],
                            sinks)
        o = jnp.einsum("bgml,bgld->bgmd", p.reshape(B, Hkv, R * n, m).astype(v.dtype), v[:, :, lo:t1],
                       preferred_element_type=jnp.float32)
        outs.append(o.reshape(B, Hkv, R, n, Dv))
    o = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)  # [B, G, R, T, Dv]
    return jnp.moveaxis(o, 3, 1).reshape(B, T, Hq, Dv).astype(v.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, ctx: AttnContext, scale: float, *,
           window: int | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """Causal (optionally sliding-window) attention of the new queries over all key slots.

    q [B, T, Hq, D], k [B, Hkv, L, D], v [B, Hkv, L, Dv] (heads-major, as the cache) -> [B, T, Hq, Dv]. Query t
    sits in slot index + t (ctx.index [] or [B]: per row) and sees slot s iff s <= index + t, key_valid[s], and
    (window) index + t - s < window (a decode step reads only the window's slots). Padding slots being
    contiguous at the start of a row, slot distances equal position distances. sinks [Hq]: a per-head logit
    joining the softmax and then dropped (GPT-OSS). A query with no visible key gets a finite (garbage) output.
    ctx.index None (a prefill from slot 0): `_prefill_attention`, the same attention over the first T slots only.
    """
    if ctx.index is None:
        return _prefill_attention(q, k, v, ctx.key_valid, scale, window, sinks)
    B, T, Hq, _ = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    q = q.reshape(B, T, Hkv, Hq // Hkv, q.shape[-1])
    q_slot = jnp.asarray(ctx.index)[..., None] + jnp.arange(T)  # [T] or [B, T]
    k_slot = jnp.arange(L)
    key_valid = ctx.key_valid
    if T == 1 and window is not None and window < L:
        # decode in a sliding window: only the last `window` slots can be seen, so read only those
        start = jnp.clip(q_slot[..., 0] - (window - 1), 0, L - window)  # [] or [B]
        k_slot = start[..., None] + jnp.arange(window)  # [window] or [B, window]
        k, v = (_window_slots(a, start, window) for a in (k, v))
        key_valid = jnp.take_along_axis(key_valid, jnp.broadcast_to(k_slot, (B, window)), axis=1)
    # decode: the GQA group's R query heads make a matmul against the keys when there is one row or the group is
    # large (MLA's latent attention: R = all heads; 20-30x faster on XLA:CPU); several rows of small groups stay
    # multiply-reduce fusions (XLA:CPU's small batched matmuls are slower there)
    group_dot = T == 1 and (B == 1 or Hq // Hkv >= 16)
    if group_dot:
        # float32 products of the stored dtype's values (exact for bfloat16), without a float32 copy of the cache
        s = jnp.einsum("bgrd,bgld->bgrl", q[:, 0], k, preferred_element_type=jnp.float32)
        s = s[:, :, :, None, :] * scale  # [B, G, R, 1, L]
    elif T == 1:
        s = jnp.sum(q[:, 0, :, :, None, :].astype(jnp.float32) * k[:, :, None].astype(jnp.float32), axis=-1)
        s = s[:, :, :, None, :] * scale  # [B, G, R, 1, L]
    else:
        s = jnp.einsum("btgrd,bgld->bgrtl", q, k).astype(jnp.float32) * scale
    allowed = k_slot[..., None, :] <= q_slot[..., None]  # [T, L] or [B, T, L]
    if window is not None:
        allowed &= (q_slot[..., None] - k_slot[..., None, :]) < window
    p = _masked_softmax(s, allowed & key_valid[:, None, :], sinks)
    if group_dot:
        o = jnp.einsum("bgrl,bgld->bgrd", p[:, :, :, 0], v.astype(jnp.float32))[:, None].astype(v.dtype)
    elif T == 1:
        o = jnp.sum(p[:, :, :, 0, :, None] * v[:, :, None].astype(jnp.float32), axis=-2)  # [B, G, R, Dv]
        o = o[:, None].astype(v.dtype)
    else:
        o = jnp.einsum("bgrtl,bgld->btgrd", p.astype(v.dtype), v)
    return o.reshape(B, T, Hq, v.shape[-1])
