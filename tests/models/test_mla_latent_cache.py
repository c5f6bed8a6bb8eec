"""DeepSeek-V3 MLA with a KV cache holds the compressed latent and absorbs kv_b_proj into the query and output:
prefill plus decode steps through that cache give the logits of the cache-less forward (which decompresses keys
and values per head, as the HF model does; itself checked against transformers in test_models_hf)."""

from __future__ import annotations


import jax.numpy as jnp
import numpy as np
import pytest

from tutel_jax.models import from_pretrained, context_from_mask, AttnContext
from support.paths import HF

L = 16  # cache slots


@pytest.mark.parametrize("case", ["deepseek_v3", "deepseek_v3_fp8"])
def test_prefill_and_decode_through_the_latent_cache_match_the_full_forward(case):
    model = from_pretrained(HF / case)
    m = model.spec.mla
    ids = jnp.asarray(np.load(HF / case / "expected.npz")["input_ids"])  # [B, T]
    B, T = ids.shape
    full, _ = model.apply(model.params, ids, context_from_mask(jnp.ones(ids.shape, bool)))  # [B, T, V]

    cache = model.init_cache(B, L)
    assert {(c["k"].shape, c["v"].shape) for c in cache} == {((B, 1, L, m.qk_rope_dim), (B, 1, L, m.kv_lora_rank))}
    slots = jnp.arange(L)
    P = T - 3  # prefill P tokens, then decode the last 3 one at a time
    ctx = AttnContext(jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P)), jnp.zeros((), jnp.int32),
                      jnp.broadcast_to(slots < P, (B, L)))
    logits, cache = model.apply(model.params, ids[:, :P], ctx, cache)
    got = [logits]
    for t in range(P, T):
        ctx = AttnContext(jnp.full((B, 1), t, jnp.int32), jnp.int32(t), jnp.broadcast_to(slots <= t, (B, L)))
        logits, cache = model.apply(model.params, ids[:, t:t + 1], ctx, cache)
        got.append(logits)
    # float32 throughout; the absorbed order of summation differs from the decompressed one only in rounding
    np.testing.assert_allclose(np.concatenate([np.asarray(g) for g in got], axis=1), np.asarray(full),
                               rtol=1e-5, atol=2e-5)
