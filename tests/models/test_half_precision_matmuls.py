"""bfloat16 matmuls of the models (`experts.matmul_out_in`: the dense projections and the lm_head through XLA;
`layers.attend` for several new tokens) sum in float32 and round once, against a float64 NumPy product rounded
the same way; and their CPU programs hold no float32 copy of a bfloat16 operand (XLA:CPU converts both operands
of a bfloat16-result matmul to float32 in memory, a whole weight per call in a prefill)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from tutel_jax.experts import linear, matmul_out_in
from tutel_jax.models._layers import AttnContext, attend

BF16_ULP = 2.0 ** -7  # the spacing of bfloat16 values in [1, 2) (8 significant bits)


def _bf16(a: np.ndarray) -> np.ndarray:
    """float64 values rounded to bfloat16 (round to nearest even), back as float64."""
    return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16), np.float64)


def _float32_shapes(fn, *args) -> set[str]:
    """The float32 array shapes of fn's compiled program for this platform, as 'f32[a,b,...]'."""
    return set(re.findall(r"f32\[[0-9,]*\]", jax.jit(fn).lower(*args).compile().as_text()))


def test_a_bfloat16_projection_sums_in_float32_and_rounds_once():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 40, 64)), jnp.bfloat16)  # 80 rows: more than a decode
    w = jnp.asarray(rng.normal(size=(96, 64)), jnp.bfloat16)
    got = jax.jit(lambda x, w: linear(x, w, impl="xla"))(x, w)
    assert got.dtype == jnp.bfloat16
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    # float32 sums of exact bfloat16 products, rounded once: within half a bfloat16 ulp plus the float32 sums'
    # rounding; a product rounded twice (or summed in bfloat16) is off by up to whole ulps
    err = np.abs(np.asarray(got, np.float64) - exact)
    assert np.all(err <= 0.5 * BF16_ULP * 2.0 ** np.floor(np.log2(np.abs(exact) + 1e-30)) + 1e-4), err.max()
    # and rounded from float32 sums (exact to the last bits here), they are the exact sums rounded
    np.testing.assert_array_equal(np.asarray(got, np.float64), _bf16(exact))
    # float32 operands: the plain float32 product
    x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(matmul_out_in(x32, w32), np.float64), exact, rtol=1e-5, atol=1e-5)


def test_a_bfloat16_projection_program_holds_no_float32_weight():
    x = jnp.zeros((1, 40, 64), jnp.bfloat16)
    w = jnp.zeros((96, 64), jnp.bfloat16)
    shapes = _float32_shapes(lambda x, w: linear(x, w, impl="xla"), x, w)
    assert "f32[96,64]" not in shapes and "f32[1,40,64]" not in shapes and "f32[40,64]" not in shapes, shapes


def _attention_reference(q, k, v, scale):
    """Causal attention of q [1, T, Hq, D] over k / v [1, Hkv, T, D] (no cache offset), float64, with the scores
    and the probabilities rounded to bfloat16 where `attend` rounds them."""
    T, hq = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    out = np.zeros(q.shape)
    causal = np.tril(np.ones((T, T), bool))
    for h in range(hq):
        g = h // (hq // hkv)
        s = _bf16(q[0, :, h] @ k[0, g].T) * scale  # [T, T]
        s = np.where(causal, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p = _bf16(p / p.sum(-1, keepdims=True))
        out[0, :, h] = p @ v[0, g]
    return out


def test_bfloat16_prefill_attention_against_float64():
    T, HQ, HKV, D = 24, 4, 2, 16
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(1, T, HQ, D)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(1, HKV, T, D)), jnp.bfloat16) for _ in range(2))
    ctx = AttnContext(jnp.arange(T, dtype=jnp.int32)[None], jnp.int32(0), jnp.ones((1, T), bool))
    got = jax.jit(lambda q, k, v: attend(q, k, v, ctx, D ** -0.5))(q, k, v)
    assert got.dtype == jnp.bfloat16
    want = _attention_reference(*(np.asarray(a, np.float64) for a in (q, k, v)), D ** -0.5)
    # the outputs round to bfloat16 once (|o| < 4 here: half an ulp is at most 2^-7); the probabilities' float32
    # softmax differs from float64's far below that
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=2.0 ** -7 + 1e-5)
    shapes = _float32_shapes(lambda q, k, v: attend(q, k, v, ctx, D ** -0.5), q, k, v)
    assert f"f32[1,{HKV},{T},{D}]" not in shapes and f"f32[{HKV},{T},{D}]" not in shapes, shapes
