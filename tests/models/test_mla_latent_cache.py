"""DeepSeek-V3 MLA with a KV cache holds the compressed latent and absorbs kv_b_proj into the query and output:
prefill plus decode steps through that cache give the logits of the cache-less forward (which decompresses keys
and values per head, as the HF model does; itself checked against transformers in test_models_hf)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tutel_jax import quant
from tutel_jax.experts import head_linear
from tutel_jax.models import from_pretrained, context_from_mask, AttnContext
from tutel_jax.models._param_layout import ABSORBED_K, ABSORBED_V
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


@pytest.mark.parametrize("case", ["deepseek_v3", "deepseek_v3_fp8"])
def test_absorbed_weights_are_kv_b_proj_halves(case):
    """On CPU the model holds kv_b_proj's halves per head: W_UK^T [H, kv_lora, nope] and W_UV [H, v, kv_lora],
    exactly the dequantized kv_b_proj's values in the model dtype."""
    for dtype in (jnp.float32, jnp.bfloat16):
        model = from_pretrained(HF / case, dtype=dtype)
        m, H = model.spec.mla, model.spec.num_heads
        for lp in model.params["layers"]:
            attn = lp["attn"]
            w = np.asarray(quant.dequantize(attn["kv_b_proj"], jnp.float32)).astype(dtype)
            w = w.reshape(H, m.qk_nope_dim + m.v_dim, m.kv_lora_rank)
            np.testing.assert_array_equal(attn[ABSORBED_K], w[:, :m.qk_nope_dim].transpose(0, 2, 1))
            np.testing.assert_array_equal(attn[ABSORBED_V], w[:, m.qk_nope_dim:])
            assert attn[ABSORBED_K].dtype == attn[ABSORBED_V].dtype == jnp.dtype(dtype)
            # device arrays: a NumPy argument would be copied into every step
            assert isinstance(attn[ABSORBED_K], jax.Array) and isinstance(attn[ABSORBED_V], jax.Array)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_head_linear_matches_float64(dtype):
    """head_linear: x [B, T, H, in] times each head's own [out, in] weight; a few rows of a bfloat16 stack go to the
    native kernel (all heads in one call), the rest to XLA: both against float64, in float32 (1e-5) and bfloat16
    (the output's rounding, 1e-2)."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(6, 24, 40)) / 40 ** 0.5, dtype)
    for rows in ((1, 1), (2, 3), (2, 40)):  # decode, a few rows, a prefill's many
        x = jnp.asarray(rng.normal(size=(*rows, 6, 40)), dtype)
        ref = np.einsum("bthi,hoi->btho", np.asarray(x, np.float64), np.asarray(w, np.float64))
        tol = 1e-5 if dtype == jnp.float32 else 1e-2
        for impl in ("auto", "xla"):
            got = head_linear(x, w, impl)
            assert got.dtype == x.dtype and got.shape == ref.shape
            native = impl == "auto" and dtype == jnp.bfloat16 and rows[0] * rows[1] <= 16
            assert ("tutel_jax_dense" in str(jax.make_jaxpr(head_linear, static_argnums=2)(x, w, impl))) == native
            np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=tol, atol=tol * np.abs(ref).max())


def test_bfloat16_decode_with_native_heads_matches_xla():
    """A bfloat16 DeepSeek decode step: the absorbed projections through the native kernel (dense_impl 'auto', CPU)
    against XLA's einsum (dense_impl 'xla'): the same logits up to bfloat16 rounding of the other projections."""
    case = HF / "deepseek_v3_fp8"
    ids = jnp.asarray(np.load(case / "expected.npz")["input_ids"])
    B, T = ids.shape
    out = []
    for impl in ("auto", "xla"):
        model = from_pretrained(case, dtype=jnp.bfloat16, dense_impl=impl)
        cache = model.init_cache(B, L)
        slots = jnp.arange(L)
        ctx = AttnContext(jnp.broadcast_to(jnp.arange(T - 1, dtype=jnp.int32), (B, T - 1)), jnp.zeros((), jnp.int32),
                          jnp.broadcast_to(slots < T - 1, (B, L)))
        _, cache = model.apply(model.params, ids[:, :T - 1], ctx, cache)
        ctx = AttnContext(jnp.full((B, 1), T - 1, jnp.int32), jnp.int32(T - 1), jnp.broadcast_to(slots < T, (B, L)))
        logits, _ = model.apply(model.params, ids[:, T - 1:], ctx, cache)
        out.append(np.asarray(logits, np.float32))
    scale = np.abs(out[1]).max()
    np.testing.assert_allclose(out[0], out[1], rtol=0, atol=3e-2 * scale)
