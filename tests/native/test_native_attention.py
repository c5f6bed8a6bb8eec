"""The native decode-attention kernel (`native.attention.decode_attention`): one query token per row over a
static KV cache, the new key and value written into the caches in place.

References: a float64 NumPy re-implementation of the documented semantics (the write at the clamped slot, the
visible slots, sinks, the softmax and the value sum; tolerance 1e-6 of the output's scale), and the XLA path it
replaces in a decode step (`models.layers.write_cache` + `attend`: the caches bit for bit, the outputs within
1e-6). Cases: float32 and bfloat16 caches, GQA groups and one head per group, head dims that are and are not a
multiple of a register, shared and per-row slots, a slot past the cache's end (clamped), sliding windows at the
start and in the middle, padding slots, sinks, and a row that sees no slot at all. `check_attention_kernel` also
runs in the other instruction sets' subprocesses (test_native_packed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from support.paths import HF
from tutel_jax.models import from_pretrained
from tutel_jax.models._layers import AttnContext, attend, write_cache
from tutel_jax.native import _build as build
from tutel_jax.native import attends_natively, decode_attention
from tutel_jax.serving import generate

needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler on this machine")

# (B, Hq, Hkv, D, L, window, sinks, index): index is shared (an int) or per row (a list)
CASES = [
    (1, 64, 8, 64, 640, None, True, 530),      # GPT-OSS-20B's full layer, a long cache
    (1, 64, 8, 64, 640, 128, True, 530),       # its sliding layer: only the window's slots are read
    (3, 8, 2, 80, 50, None, False, [3, 49, 70]),  # per-row slots, one past the end (clamped to L - 1)
    (3, 8, 2, 80, 50, 16, False, [3, 49, 70]),
    (2, 4, 4, 13, 9, 4, True, [0, 8]),         # one head per group, a head dim below one register
]


def reference(q, k, v, k_cache, v_cache, index, key_valid, scale, window, sinks):
    """float64 (o [B, Hq, Dv], k_cache, v_cache): the semantics `decode_attention` documents."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    kc, vc = np.array(k_cache, np.float64), np.array(v_cache, np.float64)
    B, _, Hq, _ = q.shape
    Hkv, L = kc.shape[1], kc.shape[2]
    R = Hq // Hkv
    index = np.broadcast_to(np.asarray(index), (B,))
    o = np.zeros((B, Hq, vc.shape[-1]))
    for b in range(B):
        qs = int(index[b])
        slot = min(max(qs, 0), L - 1)
        kc[b, :, slot], vc[b, :, slot] = k[b, 0], v[b, 0]
        lo, hi = 0, L
        if window is not None and window < L:
            lo = min(max(qs - window + 1, 0), L - window)
            hi = lo + window
        slots = np.arange(lo, hi)
        seen = key_valid[b, lo:hi] & (slots <= qs)
        if window is not None:
            seen &= qs - slots < window
        for h in range(Hq):
            g = h // R
            s = np.where(seen, kc[b, g, lo:hi] @ q[b, 0, h] * scale, np.finfo(np.float32).min)
            logits = s if sinks is None else np.append(s, float(sinks[h]))
            p = np.exp(logits - logits.max())
            p = (p / p.sum())[:hi - lo]
            o[b, h] = p @ vc[b, g, lo:hi]
    return o, kc, vc


def _case(rng, B, Hq, Hkv, D, L, dtype, sinks):
    def rand(*shape):
        return jnp.asarray(rng.normal(size=shape).astype(np.float32)).astype(dtype)
    key_valid = rng.random((B, L)) > 0.2
    key_valid[:, :2] = False  # left padding
    return (rand(B, 1, Hq, D), rand(B, 1, Hkv, D), rand(B, 1, Hkv, D), rand(B, Hkv, L, D), rand(B, Hkv, L, D),
            jnp.asarray(key_valid), rand(Hq) if sinks else None)


def check_attention_kernel(seed: int = 0) -> None:
    """Every case in float32 and bfloat16 against the float64 reference and the XLA path (also run by the other
    ISAs' subprocesses)."""
    rng = np.random.default_rng(seed)
    for B, Hq, Hkv, D, L, window, with_sinks, index in CASES:
        for dtype in (jnp.float32, jnp.bfloat16):
            q, k, v, kc, vc, key_valid, sinks = _case(rng, B, Hq, Hkv, D, L, dtype, with_sinks)
            index = jnp.asarray(index, jnp.int32)
            scale = D ** -0.5
            run = jax.jit(lambda *a, s=scale, w=window, k=sinks: decode_attention(*a, s, window=w, sinks=k))
            o, nk, nv = run(q, k, v, kc, vc, index, key_valid)
            assert o.dtype == jnp.float32 and nk.dtype == dtype and o.shape == (B, 1, Hq, D)
            ref, rk, rv = reference(q, k, v, kc, vc, index, np.asarray(key_valid), scale, window, sinks)
            np.testing.assert_array_equal(np.asarray(nk, np.float64), rk)
            np.testing.assert_array_equal(np.asarray(nv, np.float64), rv)
            err = np.abs(np.asarray(o, np.float64)[:, 0] - ref).max() / np.abs(ref).max()
            assert err <= 1e-6, (B, Hq, Hkv, D, L, dtype, window, err)
            # the XLA path of a decode step: the same caches, the same outputs (in float32 arithmetic)
            ctx = AttnContext(positions=None, index=index, key_valid=key_valid)
            xk, xv = write_cache(kc, k, index), write_cache(vc, v, index)
            np.testing.assert_array_equal(np.asarray(nk), np.asarray(xk))
            np.testing.assert_array_equal(np.asarray(nv), np.asarray(xv))
            f32 = [a if a is None else a.astype(jnp.float32) for a in (q, xk, xv, sinks)]
            xo = attend(f32[0], f32[1], f32[2], ctx, scale, window=window, sinks=f32[3])
            np.testing.assert_allclose(np.asarray(o), np.asarray(xo), rtol=0, atol=1e-6 * float(np.abs(ref).max()))


@needs_compiler
def test_decode_attention_matches_float64_reference_and_xla():
    check_attention_kernel()


@needs_compiler
@pytest.mark.parametrize("with_sinks", [False, True])
def test_row_that_sees_nothing(with_sinks):
    """A row with no visible slot gets what `attend` gives it: the mean of the values over its slots without a
    sink, zeros with one (the sink takes the whole softmax)."""
    rng = np.random.default_rng(1)
    q, k, v, kc, vc, _, sinks = _case(rng, 1, 4, 2, 16, 12, jnp.float32, with_sinks)
    nothing = jnp.zeros((1, 12), bool)
    o, _, nv = jax.jit(lambda *a: decode_attention(*a, 0.25, sinks=sinks))(q, k, v, kc, vc, jnp.int32(5), nothing)
    ref, _, _ = reference(q, k, v, kc, vc, 5, np.zeros((1, 12), bool), 0.25, None, sinks)
    expected = np.zeros_like(ref) if with_sinks else np.repeat(np.asarray(nv, np.float64).mean(2), 2, axis=1)
    np.testing.assert_allclose(ref, expected, atol=1e-12)
    np.testing.assert_allclose(np.asarray(o)[:, 0], expected, atol=1e-6)


@needs_compiler
def test_cache_updated_in_place_when_donated():
    """Donated caches are the outputs' buffers: no copy of a cache at a decode step."""
    rng = np.random.default_rng(2)
    q, k, v, kc, vc, key_valid, _ = _case(rng, 1, 8, 2, 64, 256, jnp.bfloat16, False)
    step = jax.jit(lambda q, k, v, kc, vc: decode_attention(q, k, v, kc, vc, jnp.int32(7), key_valid, 0.125),
                   donate_argnums=(3, 4))
    hlo = step.lower(q, k, v, kc, vc).compile().as_text()
    assert "copy(" not in hlo.split("ENTRY")[1]
    before = kc.unsafe_buffer_pointer()
    _, nk, _ = step(q, k, v, kc, vc)
    assert nk.unsafe_buffer_pointer() == before


@needs_compiler
def test_errors_and_rule():
    z = jnp.zeros
    with pytest.raises(ValueError, match="inconsistent shapes"):
        decode_attention(z((1, 2, 4, 8)), z((1, 1, 2, 8)), z((1, 1, 2, 8)), z((1, 2, 16, 8)), z((1, 2, 16, 8)),
                         0, z((1, 16), bool), 1.0)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        decode_attention(z((1, 1, 3, 8)), z((1, 1, 2, 8)), z((1, 1, 2, 8)), z((1, 2, 16, 8)), z((1, 2, 16, 8)),
                         0, z((1, 16), bool), 1.0)
    with pytest.raises(ValueError, match="float32 or"):
        f16 = z((1, 2, 16, 8), jnp.float16)
        decode_attention(z((1, 1, 4, 8)), z((1, 1, 2, 8)), z((1, 1, 2, 8)), f16, f16, 0, z((1, 16), bool), 1.0)
    # the models' rule: CPU, one query token, a float32 or bfloat16 cache
    assert attends_natively(z((1, 1, 4, 8)), z((1, 2, 16, 8), ml_dtypes.bfloat16))
    assert not attends_natively(z((1, 2, 4, 8)), z((1, 2, 16, 8)))  # a prefill: XLA's attention
    assert not attends_natively(z((1, 1, 4, 8)), z((1, 2, 16, 8), jnp.float16))
    # the knob (`attention_impl`): 'xla' never, 'native' for every decode step, a prefill is XLA's whatever it says
    assert not attends_natively(z((1, 1, 4, 8)), z((1, 2, 16, 8)), "xla")
    assert attends_natively(z((1, 1, 4, 8)), z((1, 2, 16, 8)), "native")
    assert not attends_natively(z((1, 2, 4, 8)), z((1, 2, 16, 8)), "native")
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        attends_natively(z((1, 1, 4, 8)), z((1, 2, 16, 8)), "flash")


@needs_compiler
def test_models_pick_the_decode_attention_by_attention_impl(monkeypatch):
    """`from_pretrained(attention_impl=...)`: a GPT-OSS decode (sliding window, sinks) through the kernel and
    through XLA's attention gives the same logits (1e-5) and tokens; only 'native' traces the kernel's call."""
    from tutel_jax.models import _attention
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return decode_attention(*args, **kwargs)

    monkeypatch.setattr(_attention, "decode_attention", counted)
    e = dict(np.load(HF / "gpt_oss" / "expected.npz"))
    runs = {}
    for impl in ("native", "xla"):
        calls.clear()
        model = from_pretrained(HF / "gpt_oss", attention_impl=impl, dense_impl="xla", dropless_impl="loop")
        assert model.spec.attention_impl == impl
        runs[impl] = generate(model, e["input_ids"], 6, return_logits=True)
        assert bool(calls) == (impl == "native"), (impl, len(calls))
    np.testing.assert_array_equal(runs["native"].sequences, runs["xla"].sequences)
    np.testing.assert_allclose(np.asarray(runs["native"].logits), np.asarray(runs["xla"].logits),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        from_pretrained(HF / "gpt_oss", attention_impl="flash")
