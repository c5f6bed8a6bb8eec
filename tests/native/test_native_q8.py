"""The native kernels' int8-activation path (`activations='int8'`, q8_rows.h): FP4 weights (MXFP4, NVFP4) times
activations quantized to int8 per block of 32 elements, in integer dot products.

References:
- `q8_reference`, a NumPy re-implementation of the activation quantization (float32 scale max|x| / 127, round
  half to even) whose dequantized activations multiply the weights' exact float64 values: the kernel equals it to
  1e-5 of the output's scale (the integer dots are exact; only float32 scaling and summation round).
- the exact float64 product, for the error the quantization itself costs (bounds below; the real-size figure is
  stated in `native.moe_experts`).
Checked for one row up to the register pass's 8 (4 on AVX2) and more (a prefill's rows go a register pass at a
time), and the wide (128) and narrow chunk tails of K.
"""

from __future__ import annotations

import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from tutel_jax.experts import _dropless as dropless
from tutel_jax.layer import make_config
from tutel_jax.models import from_pretrained
from tutel_jax.native import _build as build, dense, moe_experts
from tutel_jax.native._weights import int8_capable
from tutel_jax.serving import generate
from support.packed_weights import random_weight
from support.paths import HF

needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler: the native kernels cannot "
                                                                     "be built on this machine")

FP4 = ("mxfp4", "nvfp4", "nvfp4_mul")
# K per format: a K tail of every kind (MXFP4 224 = 128 + 96; NVFP4 208 = 128 + 64 + 16: a half block of 32
# activations at the end), and a longer row (2880, gpt-oss's width: 22 chunks of 128 and a 64-element tail);
# MXFP4 also one block (32) and whole groups of scales and one block more (544 = 512 + 32 on AVX-512, 4 x 128 +
# 32 on AVX2: `mxfp4_q8_dots` reads a register of scale codes per 4 registers of codes)
KS = {"mxfp4": (224, 2880, 32, 544), "nvfp4": (208, 2880), "nvfp4_mul": (208, 2880)}
#: the quantization's own error on these small layers, (max, rms) of |int8 - exact| / rms(exact): one matmul
#: (measured at most 2.6e-2, 7.8e-3: a block of outliers in the row), and a MoE layer's two (measured at most
#: 6.8e-2, 1.2e-2: the GLU output is quantized again); the real-size figure is in `native.moe_experts`
DENSE_QUANT_ERROR = (5e-2, 1.5e-2)
MOE_QUANT_ERROR = (1.5e-1, 2.5e-2)
#: the fixture models' first-step logits, int8 against float32 activations: max |difference| / rms(logits)
#: (measured 1.2e-2 to 3.1e-2)
LOGIT_ERROR = 6e-2


def q8_reference(x: np.ndarray) -> np.ndarray:
    """x [..., K] float32 -> the int8 path's activations, dequantized to float64: per block of 32 along K (the
    last one partial), q = round_half_even(x * (127 / max|x|)) in float32, times max|x| / 127."""
    x = np.asarray(x, np.float32)
    out = np.zeros(x.shape, np.float64)
    for k0 in range(0, x.shape[-1], 32):
        blk = x[..., k0:k0 + 32]
        amax = np.max(np.abs(blk), axis=-1, keepdims=True)
        with np.errstate(divide="ignore"):
            inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
        q = np.rint((blk * inv).astype(np.float32))
        out[..., k0:k0 + 32] = q * (amax / np.float32(127)).astype(np.float32).astype(np.float64)
    return out


def _scaled_error(got, ref) -> tuple[float, float]:
    """(max, rms) of |got - ref| over the rms of ref."""
    err = np.abs(np.asarray(got, np.float64) - ref)
    scale = np.sqrt(np.mean(ref ** 2))
    return float(err.max() / scale), float(np.sqrt(np.mean(err ** 2)) / scale)


def _check_dense_q8(fmt: str, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for k in KS[fmt]:
        w, w_ref = random_weight(rng, (200, k), fmt)  # several 64-row output blocks, the last one partial
        b = rng.normal(size=(200,)).astype(np.float32)
        # 13: register passes of 8 (4 on AVX2) and a partial one; 4 and more: MXFP4's block-lane form on AVX2
        for rows in (1, 2, 3, 4, 8, 13):
            x = rng.normal(size=(rows, k)).astype(np.float32)
            x[:, :32] *= 40.0  # one block of outliers: per-block scales keep the others exact
            got = np.asarray(jax.jit(lambda x, w, b: dense(x, w, b, activations="int8"))(x, w, b))
            exact = x.astype(np.float64) @ w_ref.T + b
            mirror = q8_reference(x) @ w_ref.T + b
            assert _scaled_error(got, mirror)[0] < 1e-5, (fmt, k, rows)
            worst, rms = _scaled_error(got, exact)
            assert worst < DENSE_QUANT_ERROR[0] and rms < DENSE_QUANT_ERROR[1], (fmt, k, rows, worst, rms)


def _moe_case(fmt: str, tokens: int, glu: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    experts, k, model_dim, hidden, out_dim = 8, 2, KS[fmt][0], 96 if fmt == "mxfp4" else 48, 150
    x = rng.normal(size=(tokens, model_dim)).astype(np.float32)
    ids = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)], axis=1).astype(np.int32)
    enc = rng.uniform(0.5, 1.5, size=ids.shape).astype(np.float32)
    enc[:, -1] = enc[0, -1]  # one token's experts share its quantized row (prepared once and copied)
    dec = rng.uniform(0.1, 1.0, size=ids.shape).astype(np.float32)
    w2, w2_ref = random_weight(rng, (experts, out_dim, hidden), fmt)
    w1, w1_ref = random_weight(rng, (experts, 2 * hidden, model_dim), fmt)
    kwargs = dict(glu=glu)
    if glu == "gpt_oss":
        kwargs.update(b1=rng.normal(size=(experts, 2 * hidden)).astype(np.float32),
                      b2=rng.normal(size=(experts, out_dim)).astype(np.float32))
    return (x, ids, enc, dec, w1, w2), kwargs, (w1_ref, w2_ref)


def _moe_exact(x, ids, enc, dec, w1, w2, b1=None, b2=None, glu="swiglu", quantize=lambda a: a):
    """float64 MoE layer; `quantize` maps each expert input (enc * x, then the GLU output) to what multiplies
    the weights."""
    y = np.zeros((x.shape[0], w2.shape[1]))
    hidden = w2.shape[2]
    for kk, s in np.ndindex(*ids.shape):
        e = int(ids[kk, s])
        h = w1[e] @ quantize(enc[kk, s] * x[s]) + (0 if b1 is None else b1[e])
        if glu == "swiglu":
            a = h[:hidden] / (1 + np.exp(-h[:hidden])) * h[hidden:]
        else:
            gate, up = np.minimum(h[0::2], 7.0), np.clip(h[1::2], -7.0, 7.0)
            a = (up + 1) * gate / (1 + np.exp(-1.702 * gate))
        y[s] += float(dec[kk, s]) * (w2[e] @ quantize(a.astype(np.float32)) + (0 if b2 is None else b2[e]))
    return y


def check_q8_kernels() -> None:
    """Every FP4 format through both kernels (also run by the other ISAs' subprocesses, test_native_packed)."""
    for fmt in FP4:
        _check_dense_q8(fmt)
        for glu in ("swiglu", "gpt_oss"):
            _check_moe_q8(fmt, glu)


def _check_moe_q8(fmt: str, glu: str) -> None:
    for tokens in (1, 5, 40):  # one row per expert, a few, and more than a register pass for some experts
        # (every count takes the int8 path)
        args, kwargs, (w1_ref, w2_ref) = _moe_case(fmt, tokens, glu)
        got = np.asarray(jax.jit(lambda *a: moe_experts(*a, activations="int8", **kwargs))(*args))
        x, ids, enc, dec = args[:4]
        exact = _moe_exact(x, ids, enc, dec, w1_ref, w2_ref, kwargs.get("b1"), kwargs.get("b2"), glu)
        worst, rms = _scaled_error(got, exact)
        assert worst < MOE_QUANT_ERROR[0] and rms < MOE_QUANT_ERROR[1], (fmt, glu, tokens, worst, rms)
        if tokens == 1:  # W1's activations are mirrored exactly; a rounding of the GLU output may flip one
            mirror = _moe_exact(x, ids, enc, dec, w1_ref, w2_ref, kwargs.get("b1"), kwargs.get("b2"), glu,
                                quantize=lambda a: q8_reference(a[None])[0])
            assert _scaled_error(got, mirror)[1] < 1e-4, (fmt, glu)
        if tokens == 1:  # every expert has one row: the int8 path ran
            float_path = np.asarray(jax.jit(lambda *a: moe_experts(*a, **kwargs))(*args))
            assert not np.array_equal(got, float_path)


@needs_compiler
@pytest.mark.parametrize("fmt", FP4)
def test_dense_int8_activations_match_their_reference(fmt):
    _check_dense_q8(fmt)


@needs_compiler
@pytest.mark.parametrize("glu", ["swiglu", "gpt_oss"])
@pytest.mark.parametrize("fmt", FP4)
def test_moe_int8_activations_match_their_reference(fmt, glu):
    _check_moe_q8(fmt, glu)


@needs_compiler
def test_int8_activations_leave_other_weights_alone():
    """FP8 block and float weights take float32 activations whatever is asked; bad values are one clear error."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 256)).astype(np.float32)
    for w in (pallas_kernels.quantize_fp8_block(jnp.asarray(rng.normal(size=(64, 256)), jnp.float32)),
              jnp.asarray(rng.normal(size=(64, 256)), jnp.bfloat16)):
        assert not int8_capable(w)
        np.testing.assert_array_equal(np.asarray(dense(x, w, activations="int8")), np.asarray(dense(x, w)))
    assert int8_capable("mxfp4") and int8_capable("nvfp4") and not int8_capable("fp8_block")
    with pytest.raises(ValueError, match="activations must be one of"):
        dense(x, jnp.zeros((64, 256), jnp.bfloat16), activations="int4")


@needs_compiler
@pytest.mark.parametrize("rows", [2, 5])  # 5: the block-lane form on AVX2
def test_int8_activations_keep_non_finite_inputs_visible(rows):
    """A NaN or infinite activation makes the rows it enters NaN or infinite, as in float32 (never a finite
    number from a zeroed block); the other rows stay finite."""
    rng = np.random.default_rng(4)
    w, _ = random_weight(rng, (64, 288), "mxfp4")  # a partial last group of 256 elements
    x = rng.normal(size=(rows, 288)).astype(np.float32)
    x[0, 40], x[1, 270] = np.nan, np.inf
    got = np.asarray(dense(x, w, activations="int8"))
    assert not np.isfinite(got[:2]).any() and np.isfinite(got[2:]).all()


@needs_compiler
def test_auto_picks_int8_for_fp4_experts_on_cpu():
    """'auto' on CPU: int8 activations for FP4 experts where the build's byte dot products are vector code."""
    fp4 = "native_int8" if build.int8_pays_off() else "native"  # the portable build keeps float32
    for fmt, expected in (("mxfp4", fp4), ("nvfp4", fp4), ("fp8_block", "native")):
        experts = {"type": "swiglu", "count_per_node": 8, "hidden_size_per_expert": 64, "weight_format": fmt}
        auto = make_config({"type": "top", "k": 2}, 128, experts)
        assert dropless.resolve_impl("auto", auto.experts, 8, 8) == expected


@needs_compiler
@pytest.mark.parametrize("case", ["gpt_oss_mxfp4", "qwen3_moe_nvfp4"])
def test_fixture_models_int8_greedy_tokens_follow_float(case):
    """The FP4 fixture models with int8 activations (the default on CPU) against float32 ones, 12 greedy steps of
    two rows. The first step's logits (same inputs, no history) agree within LOGIT_ERROR of their rms, and a
    row's first different token is at a near tie: the float path's top two logits within twice the paths' logit
    difference at that step. These tiny random-weight models have flat distributions (top-two margins of a few
    hundredths) and near-tied routers, so after a first difference the rows go apart; which steps differ is
    printed (measured: gpt_oss_mxfp4 rows 0, 1 at steps 11, 2; qwen3_moe_nvfp4 rows 0, 1 at steps 0, 2: row 0's
    first token is a tie of 0.015 against a logit difference of 0.091, the prefill's activations being int8 too)."""
    e = dict(np.load(HF / case / "expected.npz"))
    int8 = from_pretrained(HF / case)  # auto: native_int8 experts and dense FP4 projections
    exact = from_pretrained(HF / case, dropless_impl="native", dense_impl="native")
    a = generate(int8, e["input_ids"], 12, return_logits=True)
    b = generate(exact, e["input_ids"], 12, return_logits=True)
    prompt = e["input_ids"].shape[1]
    np.testing.assert_array_equal(b.sequences[:, :e["greedy"].shape[1]], e["greedy"])
    la, lb = np.asarray(a.logits, np.float64), np.asarray(b.logits, np.float64)
    diff = np.abs(la - lb).max(axis=-1)  # [B, steps]
    assert np.all(diff[:, 0] <= LOGIT_ERROR * np.sqrt(np.mean(lb[:, 0] ** 2, axis=-1))), diff[:, 0]
    for row in range(a.sequences.shape[0]):
        new_a, new_b = a.sequences[row, prompt:], b.sequences[row, prompt:]
        differ = np.flatnonzero(new_a != new_b)
        if differ.size:
            step = differ[0]
            margin = lb[row, step, new_b[step]] - lb[row, step, new_a[step]]
            print(f"{case} row {row}: step {step} of 12 differs; float margin {margin:.3f}, logit difference "
                  f"{diff[row, step]:.3f}")
            assert 0 <= margin <= 2 * diff[row, step], (row, step, margin, diff[row, step])


_DOT4_CHECK = r"""
#include <cstdio>
#include <random>
#include "simd.h"
int main() {  // dot4 against integer arithmetic on random bytes, the extremes included
  static_assert(!tj::kDotInstruction, "built without a dot-product instruction");
  std::mt19937 g(0);
  for (int it = 0; it < 20000; ++it) {
    tj::QNative u, s;
    tj::INative acc;
    for (int i = 0; i < tj::kQBytes; ++i) {
      u[i] = it < 2 ? 24 : g() % 25;
      s[i] = uint8_t(int8_t(it == 0 ? 127 : it == 1 ? -127 : int(g() % 255) - 127));
    }
    for (int l = 0; l < tj::kNativeLanes; ++l) acc[l] = int32_t(g() % 2001) - 1000;
    const tj::INative got = tj::dot4(acc, u, s);
    for (int l = 0; l < tj::kNativeLanes; ++l) {
      int32_t want = acc[l];
      for (int i = 0; i < 4; ++i) want += int32_t(u[4 * l + i]) * int32_t(int8_t(s[4 * l + i]));
      if (got[l] != want) { std::printf("mismatch %d %d: %d != %d\n", it, l, got[l], want); return 1; }
    }
  }
  std::printf("ok isa %d\n", int(tj::kIsa));
  return 0;
}
"""


@needs_compiler
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_int8_dot_without_a_dot_product_instruction(tmp_path, isa):
    """The x86 builds for CPUs without VNNI (most AVX2 CPUs: vpmaddubsw + vpmaddwd) compute the same int32 lanes:
    compiled with the VNNI extensions switched off and run on random bytes against integer arithmetic (the rest of
    the int8 path is shared code, tested above with this CPU's own build)."""
    if isa not in build.cpu_isas():
        pytest.skip(f"this CPU does not run {isa}")
    source = tmp_path / "dot4.cc"
    source.write_text(_DOT4_CHECK)
    off = {"avx512": ["-march=native", "-mno-avx512vnni"],
           "avx2": ["-march=native", "-mno-avx512f", "-mno-avxvnni"]}[isa]
    exe = tmp_path / "dot4"
    done = subprocess.run([build.compiler(), "-O2", "-std=c++17", "-Wno-psabi", *off,
                           f"-DTUTEL_JAX_REQUIRE_ISA={build.ISAS.index(isa)}", "-I", str(build.SOURCE_DIR),
                           str(source), "-o", str(exe)], check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    run = subprocess.run([str(exe)], check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith(f"ok isa {build.ISAS.index(isa)}"), run.stdout + run.stderr
