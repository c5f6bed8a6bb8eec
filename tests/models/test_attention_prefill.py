"""`layers.attend` for a prefill (ctx.index None: T new tokens at slots 0 .. T-1 of an empty cache, attended in
blocks of queries over the keys each block can see) against a float64 NumPy attention over every cache slot."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tutel_jax.models._layers import PREFILL_MIN_BLOCK, AttnContext, attend

D = 8


def _reference(q, k, v, key_valid, scale, window, sinks):
    """q [B, T, Hq, D] at slots 0 .. T-1, k / v [B, Hkv, L, D] -> [B, T, Hq, D], float64, every slot masked
    explicitly (a query with no visible key: zeros; such queries are padding and not compared)."""
    B, T, hq, _ = q.shape
    hkv, L = k.shape[1], k.shape[2]
    out = np.zeros((B, T, hq, v.shape[-1]))
    slots = np.arange(L)
    for b in range(B):
        for t in range(T):
            seen = (slots <= t) & key_valid[b]
            if window is not None:
                seen &= t - slots < window
            if not seen.any():
                continue
            for h in range(hq):
                g = h // (hq // hkv)
                logits = np.where(seen, k[b, g] @ q[b, t, h] * scale, -np.inf)
                extra = [sinks[h]] if sinks is not None else []
                m = np.max([logits.max(), *extra])
                e = np.exp(logits - m)
                out[b, t, h] = (e / (e.sum() + sum(np.exp(x - m) for x in extra))) @ v[b, g]
    return out


def _inputs(rows, T, L, hq, hkv, seed):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(rows, T, hq, D)).astype(np.float32)
    k, v = (rng.normal(size=(rows, hkv, L, D)).astype(np.float32) for _ in range(2))
    key_valid = np.ones((rows, L), bool)
    key_valid[-1, :3] = False  # left padding in the last row
    return q, k, v, key_valid


LONG = PREFILL_MIN_BLOCK * 2 + 37  # several blocks, the last one partial
# (T, heads, window): one block and several; GQA groups of 2 and one group of 32 (MLA's latent form); full
# attention and windows within a block, across blocks and past T (the long prompt with 32 heads: two windows,
# to keep the float64 loops short)
CASES = ([(5, heads, w) for heads in ((4, 2), (32, 1)) for w in (None, 4, 150, 1000)]
         + [(LONG, (4, 2), w) for w in (None, 4, 150, 1000)] + [(LONG, (32, 1), w) for w in (None, 150)])


@pytest.mark.parametrize("T,heads,window", CASES)
@pytest.mark.parametrize("extra_slots", [0, 19])  # a cache of exactly T slots; longer (slots past T unread)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_prefill_equals_float64_attention_over_every_slot(T, heads, window, extra_slots, with_sinks):
    hq, hkv = heads
    L = T + extra_slots
    q, k, v, key_valid = _inputs(2, T, L, hq, hkv, seed=T + extra_slots + (window or 0))
    sinks = np.random.default_rng(1).normal(size=(hq,)).astype(np.float32) if with_sinks else None
    # the attention's cache holds garbage past slot T, which a prefill never reads (inf: any product would show)
    k_cache, v_cache = k.copy(), v.copy()
    k_cache[:, :, T:], v_cache[:, :, T:] = np.inf, np.inf
    ctx = AttnContext(jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T)), None, jnp.asarray(key_valid))
    got = jax.jit(lambda q, k, v, ctx: attend(q, k, v, ctx, D ** -0.5, window=window,
                                              sinks=None if sinks is None else jnp.asarray(sinks)))(
        q, k_cache, v_cache, ctx)
    want = _reference(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), key_valid, D ** -0.5,
                      window, sinks)
    real = np.ones((2, T), bool)
    real[-1, :3] = False  # padding queries see no key: their output is never used
    np.testing.assert_allclose(np.asarray(got)[real], want[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 100])
def test_prefill_equals_the_general_path_in_bfloat16(window):
    """The same attention through the general path (index 0 over every slot) in bfloat16: the prefill's scores are
    float32 products of the bfloat16 values, the general path's bfloat16, so they agree to bfloat16's rounding."""
    T, L, hq, hkv = 300, 320, 8, 2
    q, k, v, key_valid = (jnp.asarray(a, jnp.bfloat16) if a.dtype == np.float32 else jnp.asarray(a)
                          for a in _inputs(1, T, L, hq, hkv, seed=7))
    sinks = jnp.asarray(np.random.default_rng(2).normal(size=(hq,)), jnp.float32)
    positions = jnp.arange(T, dtype=jnp.int32)[None]
    out = [attend(q, k, v, AttnContext(positions, index, key_valid), D ** -0.5, window=window, sinks=sinks)
           for index in (None, jnp.zeros((), jnp.int32))]
    assert out[0].dtype == out[1].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out[0], np.float32), np.asarray(out[1], np.float32), rtol=0, atol=3e-2)
