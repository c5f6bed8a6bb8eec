"""`layers.attend` for one new token (decode: a matmul for one row or a large query group, multiply-reduce otherwise, a sliding window
read as its last `window` slots only) against a float64 NumPy attention over every cache slot."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tutel_jax.models._layers import AttnContext, attend

L, HQ, HKV, D = 16, 4, 2, 8


def _reference(q, k, v, index, key_valid, scale, window, sinks):
    """q [B, 1, Hq, D], k / v [B, Hkv, L, D], index [B] -> [B, 1, Hq, D], float64, every slot masked explicitly."""
    B, _, hq, _ = q.shape
    hkv = k.shape[1]
    out = np.zeros((B, 1, hq, D))
    for b in range(B):
        for h in range(hq):
            g = h // (hq // hkv)
            s = k[b, g] @ q[b, 0, h] * scale  # [L]
            slots = np.arange(L)
            seen = (slots <= index[b]) & key_valid[b]
            if window is not None:
                seen &= index[b] - slots < window
            logits = np.where(seen, s, -np.inf)
            extra = [sinks[h]] if sinks is not None else []
            m = np.max([logits.max(), *extra])
            e = np.exp(logits - m)
            denom = e.sum() + sum(np.exp(x - m) for x in extra)
            out[b, 0, h] = (e / denom) @ v[b, g]
    return out


@pytest.mark.parametrize("rows", [1, 3])  # the matmul path; several rows: multiply-reduce for small query groups
@pytest.mark.parametrize("heads", [(HQ, HKV), (32, 1)])  # groups of 2 query heads; of 32 (matmul at any rows)
@pytest.mark.parametrize("window", [None, 4, 32])  # full; a window shorter than the cache (sliced); longer
@pytest.mark.parametrize("per_row_index", [False, True])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_decode_equals_float64_attention_over_every_slot(rows, heads, window, per_row_index, with_sinks):
    hq, hkv = heads
    rng = np.random.default_rng(rows * 100 + (window or 0))
    q = rng.normal(size=(rows, 1, hq, D)).astype(np.float32)
    k, v = (rng.normal(size=(rows, hkv, L, D)).astype(np.float32) for _ in range(2))
    sinks = rng.normal(size=(hq,)).astype(np.float32) if with_sinks else None
    # rows at different positions (per-row index) or one shared index; index 2: a window clipped at slot 0;
    # left padding in the last row
    index = np.array([9, 2, 15][:rows]) if per_row_index else np.full(rows, 11)
    key_valid = np.ones((rows, L), bool)
    key_valid[-1, :2] = False
    ctx = AttnContext(jnp.asarray(index[:, None], jnp.int32),
                      jnp.asarray(index if per_row_index else index[0], jnp.int32), jnp.asarray(key_valid))
    got = jax.jit(lambda q, k, v, ctx: attend(q, k, v, ctx, D ** -0.5, window=window,
                                              sinks=None if sinks is None else jnp.asarray(sinks)))(q, k, v, ctx)
    want = _reference(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), index, key_valid,
                      D ** -0.5, window, sinks)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
