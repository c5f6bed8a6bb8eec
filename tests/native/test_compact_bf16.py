"""Compact bfloat16 (`native.CompactBf16`): a bfloat16 weight in 12 bits per element, losslessly.

References: the bfloat16 weight itself (the container's `dequantize` gives back every bit: signed zeros,
subnormals, inf, NaN, exponents outside the codes' table); float64 NumPy for the native dense kernel on it (every
ISA this CPU runs: `test_native_packed`'s checks include the format) and for its native decoder (`bfloat16()`,
bit-exact); the same checkpoint loaded without the
compact layout (the fixture model in bfloat16: logits within one bfloat16 rounding of the output's scale, the
same greedy tokens, the same exported tensors).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from support.paths import HF
from tutel_jax.models import from_pretrained
from tutel_jax.models._export import hf_tensors
from tutel_jax.native import CompactBf16, _build as build, compact_bf16, compact_pays_off, dense
from tutel_jax.native._compact_bf16 import GROUP_BYTES, SLOTS
from tutel_jax.serving import generate

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler: the encoder and kernel are native")

BF16 = ml_dtypes.bfloat16


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint16)


def _weight(rng, n=70, k=96, scale=0.05) -> np.ndarray:
    w = (rng.normal(size=(n, k)) * scale).astype(BF16)
    specials = [0.0, -0.0, 1e-39, -2e-40, np.inf, -np.inf, np.nan, 3e4, -1e-20, 2.0 ** -100]
    for i, v in enumerate(specials):
        w[(5 * i) % n, (11 * i + 3) % k] = v
    w[1] = 0  # a row of zeros (no patches)
    return w


def test_round_trip_is_bit_exact():
    rng = np.random.default_rng(0)
    w = _weight(rng)
    c = compact_bf16(w)
    assert isinstance(c, CompactBf16) and c.shape == w.shape and c.groups.shape == (70, 3, GROUP_BYTES)
    assert c.patches.shape[0] >= 6  # inf / NaN and the far exponents (zeros and subnormals have slot 0)
    np.testing.assert_array_equal(_bits(c.dequantize()), _bits(w))
    np.testing.assert_array_equal(_bits(jax.jit(lambda c: c.dequantize())(c)), _bits(w))
    np.testing.assert_array_equal(_bits(jax.jit(lambda c: c.bfloat16())(c)), _bits(w))  # the native decoder
    # the table holds high byte 0 and the 7 most frequent others (but the sign), each positive then negative
    highs = (_bits(w) >> 8) & 0x7F
    counts = np.bincount(highs.ravel(), minlength=128)
    table = np.asarray(c.index[:16]).view(np.uint32) >> 24
    assert table[0] == 0 and set(table[1:SLOTS]) == set(np.argsort(-counts[1:], kind="stable")[:SLOTS - 1] + 1)
    np.testing.assert_array_equal(table[SLOTS:], table[:SLOTS] | 0x80)
    # a padded patch list stands for the same weight
    padded = c.with_patch_capacity(c.patches.shape[0] + 5)
    np.testing.assert_array_equal(_bits(padded.dequantize()), _bits(w))
    np.testing.assert_array_equal(_bits(padded.bfloat16()), _bits(w))
    x = rng.normal(size=(3, 96)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(dense)(x, padded)), np.asarray(jax.jit(dense)(x, c)))
    with pytest.raises(ValueError, match="patches do not fit"):
        c.with_patch_capacity(1)


def test_twelve_bits_per_element_for_normal_weights():
    w = (np.random.default_rng(1).normal(size=(256, 2880)) * 0.02).astype(BF16)
    c = compact_bf16(w)
    assert c.patches.shape[0] < 2e-3 * w.size  # ~0.015% of a normal weight's elements
    assert c.nbytes() < 0.76 * 2 * w.size


def test_weights_it_does_not_take():
    rng = np.random.default_rng(2)
    assert compact_bf16(rng.normal(size=(8, 64)).astype(np.float32)) is None  # not bfloat16
    assert compact_bf16(rng.normal(size=(8, 48)).astype(BF16)) is None  # K not a multiple of 32
    assert compact_bf16(rng.normal(size=(2, 8, 64)).astype(BF16)) is None  # not 2-d
    assert compact_bf16(np.zeros((0, 64), BF16)) is None
    # exponents spread over the whole range: too many patches to save anything
    spread = rng.integers(0, 1 << 16, size=(16, 256), dtype=np.uint16).view(BF16)
    assert compact_bf16(spread) is None


def test_kernel_matches_float64_with_bfloat16_and_float32_rows():
    rng = np.random.default_rng(3)
    w = _weight(rng, n=130, k=2880, scale=0.02)
    w[np.isnan(w.astype(np.float32)) | np.isinf(w.astype(np.float32))] = 1.5  # finite products to compare
    c = compact_bf16(w)
    w64 = w.astype(np.float64)
    for rows in (1, 2, 5, 8, 9, 12, 16, 17):  # float32 rows: register passes of 8 up to 8 or 16 rows, then tiles
        x32 = rng.normal(size=(rows, 2880)).astype(np.float32)
        for x in (x32.astype(BF16).astype(np.float32), x32):
            want = x.astype(np.float64) @ w64.T
            got = np.asarray(jax.jit(dense)(x, c), np.float64)
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max(), err_msg=f"{rows} rows")


def test_kernel_rejects_an_index_that_points_outside():
    c = compact_bf16(_weight(np.random.default_rng(4)))
    bad = np.asarray(c.patches).copy()
    bad[0, 1] = 96  # a column past K
    with pytest.raises(Exception, match="compact bfloat16 patch outside its row"):
        jax.block_until_ready(dense(np.ones((1, 96), np.float32), CompactBf16(c.groups, c.index, jnp.asarray(bad))))
    index = np.asarray(c.index).copy()
    index[-1] = c.patches.shape[0] + 1  # more patches than the list holds
    with pytest.raises(Exception, match="patch index out of range"):
        jax.block_until_ready(dense(np.ones((1, 96), np.float32), CompactBf16(c.groups, jnp.asarray(index), c.patches)))


def test_a_bfloat16_model_loads_compact_with_the_same_results():
    """The Qwen3-MoE fixture in bfloat16: 'auto' is compact exactly where the build decodes it at the memory's speed;
    compact, its dense weights are `CompactBf16` and it gives the uncompacted model's logits (prefill: the same
    bfloat16 weights through XLA; decode: the native kernel, float32 sums) and greedy tokens, and exports the same
    tensors."""
    path = HF / "qwen3_moe"
    auto = from_pretrained(path, dtype=jnp.bfloat16)
    compact = from_pretrained(path, dtype=jnp.bfloat16, compact_bf16=True)
    plain = from_pretrained(path, dtype=jnp.bfloat16, compact_bf16=False)
    kinds = lambda m: {type(v).__name__ for v in m.params["layers"][0]["attn"].values()}
    assert ("CompactBf16" in kinds(auto)) == compact_pays_off()
    assert "CompactBf16" in kinds(compact) and "CompactBf16" not in kinds(plain)
    assert isinstance(compact.params["lm_head"], CompactBf16)
    # one shape per weight over the layers: one block program
    shapes = {tuple(lp["attn"]["qkv_proj"].patches.shape) for lp in compact.params["layers"]}
    assert len(shapes) == 1
    ids = np.array([[3, 17, 42, 5, 9, 11]], np.int32)
    a = generate(compact, ids, max_new_tokens=10, return_logits=True)
    b = generate(plain, ids, max_new_tokens=10, return_logits=True)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    la, lb = np.asarray(a.logits, np.float64), np.asarray(b.logits, np.float64)
    # float32 sums that differ only in their order, each rounded to bfloat16: at most a bfloat16 rounding apart
    np.testing.assert_allclose(la, lb, rtol=0, atol=2 ** -8 * np.abs(lb).max())
    ours, theirs = hf_tensors(compact), hf_tensors(plain)
    assert ours.keys() == theirs.keys()
    for name in ours:
        np.testing.assert_array_equal(_bits(ours[name]) if ours[name].dtype == BF16 else ours[name],
                                      _bits(theirs[name]) if theirs[name].dtype == BF16 else theirs[name],
                                      err_msg=name)
    with pytest.raises(ValueError, match="compact_bf16 must be True, False or 'auto'"):
        from_pretrained(path, compact_bf16="yes")
