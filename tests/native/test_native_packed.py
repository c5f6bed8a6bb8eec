"""The native CPU kernels on packed weights: `native.moe_experts` (FP8 block, MXFP4, NVFP4 and float experts,
SwiGLU and GPT-OSS) and `native.dense` (a linear layer for a few rows).

References: float64 NumPy on the weights' exact float32 dequantization (`pallas_kernels.quant`'s dequantizers,
themselves checked against NumPy in test_pallas_quant), tolerance 1e-5 of the output's scale; the MoE layer's
XLA 'loop' path (1e-5); the fixture models through the XLA paths (greedy tokens equal, logits within 1e-5) and
transformers' (expected.npz). Shapes cover the decode form (<= 8 rows per expert) and the many-row form, wide
(128) and narrow (32) FP4 chunks, scalar K tails, partial FP8 scale blocks and output blocks. The best
instruction set this CPU runs is checked here; every other one it runs (AVX2, portable C++) runs the same checks, and
test_native_q8's, in a subprocess built with TUTEL_JAX_NATIVE_ISA.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels.quant import Nvfp4Weight
from tutel_jax.experts import _dropless as dropless
from tutel_jax.layer import make_config, init_params, moe_apply
from tutel_jax.models import context_from_mask, from_pretrained
from tutel_jax.native import _build as build, dense, moe_experts
from tutel_jax.serving import generate
from support.packed_weights import random_weight
from support.paths import HF, REPO

needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler: the native kernels cannot "
                                                                     "be built on this machine")

# (M, I) per format: K tails of every kind (FP8: 200 = 6 x 32 + 8; MXFP4: 224 = 128 + 3 x 32; NVFP4: 208 =
# 128 + 2 x 32 + 16, and I = 48 = 32 + 16)
DIMS = {"fp8_block": (200, 72), "mxfp4": (224, 96), "nvfp4": (208, 48), "nvfp4_mul": (208, 48),
        "int8": (200, 72), "fp8_channel": (200, 72), "float32": (72, 40), "bfloat16": (72, 40)}
DIMS["compact_bf16"] = (96, 40)  # a dense layer's weight only (no experts' form); K a multiple of 32
DENSE_FORMATS = list(DIMS)
FORMATS = [f for f in DENSE_FORMATS if f != "compact_bf16"]  # the experts' formats
SHAPES = {"decode": (6, 2, 8), "prefill": (48, 2, 4)}  # (S, k, E): <= 8 rows per expert, then ~24


def _moe_reference(x, ids, enc, dec, w1, w2, b1, b2, glu, alpha=1.702, limit=7.0):
    """float64: w1 [E, 2I, M] ([gate | up] halves for 'swiglu', interleaved for 'gpt_oss'), w2 [E, Mo, I]."""
    y = np.zeros((x.shape[0], w2.shape[1]))
    hidden = w2.shape[2]
    for k, s in np.ndindex(*ids.shape):
        e = int(ids[k, s])
        if not 0 <= e < w1.shape[0] or enc[k, s] == 0 or dec[k, s] == 0:
            continue
        h = w1[e] @ (float(enc[k, s]) * x[s].astype(np.float64)) + (0 if b1 is None else b1[e])
        if glu == "swiglu":
            a = h[:hidden] / (1 + np.exp(-h[:hidden])) * h[hidden:]
        else:
            gate, up = np.minimum(h[0::2], limit), np.clip(h[1::2], -limit, limit)
            a = (up + 1) * gate / (1 + np.exp(-alpha * gate))
        y[s] += float(dec[k, s]) * (w2[e] @ a + (0 if b2 is None else b2[e]))
    return y


def _close(got, ref, tol=1e-5):
    got = np.asarray(got)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * max(1.0, float(np.abs(ref).max())))


def _moe_case(fmt, shape, glu, seed=0):
    rng = np.random.default_rng(seed)
    (tokens, k, experts), (model_dim, hidden) = SHAPES[shape], DIMS[fmt]
    out_dim = 150  # not a multiple of the 64-wide output blocks
    x = rng.normal(size=(tokens, model_dim)).astype(np.float32)
    ids = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)], axis=1).astype(np.int32)
    enc = rng.uniform(0.5, 1.5, size=ids.shape).astype(np.float32)
    enc[:, -1] = enc[0, -1]  # one token's experts share its input row (prepared once and copied), the others not
    dec = rng.uniform(0.1, 1.0, size=ids.shape).astype(np.float32)
    ids[0, 0], ids[-1, -1] = -1, 2 ** 30  # not this device's experts: skipped
    enc[0, 1] = 0.0  # dropped assignments: skipped
    dec[-1, 0] = 0.0
    w2, w2_ref = random_weight(rng, (experts, out_dim, hidden), fmt)
    kwargs, b1, b2 = {}, None, None
    if glu == "gpt_oss":
        w1, w1_ref = random_weight(rng, (experts, 2 * hidden, model_dim), fmt)
        b1 = rng.normal(size=(experts, 2 * hidden)).astype(np.float32)
        b2 = rng.normal(size=(experts, out_dim)).astype(np.float32)
        kwargs = dict(b1=b1, b2=b2, glu="gpt_oss", alpha=1.702, limit=7.0)
    elif shape == "tails":  # SwiGLU with one fused W1 [E, 2I, M]: gate rows, then up rows
        w1, w1_ref = random_weight(rng, (experts, 2 * hidden, model_dim), fmt)
    else:  # SwiGLU's gate and up apart, as the experts hold them
        w1, gate_ref = random_weight(rng, (experts, hidden, model_dim), fmt)
        up, up_ref = random_weight(rng, (experts, hidden, model_dim), fmt)
        w1_ref = np.concatenate([gate_ref, up_ref], axis=1)
        kwargs = dict(up=up)
    ref = _moe_reference(x, ids, enc, dec, w1_ref, w2_ref, b1, b2, glu)
    return (x, ids, enc, dec, w1, w2), kwargs, ref


def check_kernels_against_reference(shapes=tuple(SHAPES)) -> None:
    """Every format and GLU, in `shapes`, through both kernels (also run by the other ISAs' subprocesses)."""
    for fmt in FORMATS:
        for shape in shapes:
            for glu in ("swiglu", "gpt_oss"):
                args, kwargs, ref = _moe_case(fmt, shape, glu)
                _close(jax.jit(lambda *a, kw=kwargs: moe_experts(*a, **kw))(*args), ref)
    for fmt in DENSE_FORMATS:
        _check_dense(fmt)
    check_e4m3_codes()
    check_channel_codes()


def check_e4m3_codes() -> None:
    """Each of the 254 finite e4m3fn codes (zeros, subnormals, normals, both signs) alone in its row, at a
    different lane of a register each, times activations that are powers of two: every output is exact (the
    one-row, register-pass and many-row kernels)."""
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    K = 128
    data = np.zeros((codes.size, K), np.uint8)
    data[np.arange(codes.size), np.arange(codes.size) % K] = codes
    w = pallas_kernels.Fp8BlockWeight(jnp.asarray(data.view(ml_dtypes.float8_e4m3fn)),
                                      jnp.full((2, 1), 0.5, jnp.float32))
    value = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    for rows in (1, 3, 12):
        x = np.ones((rows, K), np.float32) * (2.0 ** np.arange(rows, dtype=np.float32))[:, None]
        np.testing.assert_array_equal(np.asarray(jax.jit(dense)(x, w)), x[:, :1] * 0.5 * value[None, :])


def check_channel_codes() -> None:
    """Each int8 code (all 256) and each finite e4m3 code (254) alone in its row (at a different lane of a register
    each) with a power-of-two channel scale, times activations that are powers of two: every output is exact
    (int8's sign extension of -128 .. -1 and e4m3's subnormals included; the one-row, register-pass and many-row
    kernels)."""
    e4m3 = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8).view(ml_dtypes.float8_e4m3fn)
    K = 160  # a 32-column tail past the register chunks of 128
    for codes, container in ((np.arange(-128, 128, dtype=np.int8), pallas_kernels.Int8Weight),
                             (e4m3, pallas_kernels.Fp8ChannelWeight)):
        data = np.zeros((codes.size, K), codes.dtype)
        data[np.arange(codes.size), (5 * np.arange(codes.size)) % K] = codes
        scale = (2.0 ** -(np.arange(codes.size) % 7))[:, None].astype(np.float32)
        w = container(jnp.asarray(data), jnp.asarray(scale, jnp.float32))
        value = codes.astype(np.float64) * scale[:, 0]
        for rows in (1, 3, 12):
            x = np.ones((rows, K), np.float32) * (2.0 ** np.arange(rows, dtype=np.float32))[:, None]
            np.testing.assert_array_equal(np.asarray(jax.jit(dense)(x, w)), x[:, :1] * value[None, :],
                                          err_msg=container.__name__)


def _check_dense(fmt, seed=1):
    rng = np.random.default_rng(seed)
    model_dim = DIMS[fmt][0]
    w, w_ref = random_weight(rng, (600, model_dim), fmt)  # several 64-row output blocks, the last one partial
    b = rng.normal(size=(600,)).astype(np.float32)
    for rows in (1, 2, 3, 11, 17):  # one row, two, a few, two register passes of 8, decoded tiles
        x = rng.normal(size=(rows, model_dim)).astype(np.float32)
        _close(jax.jit(dense)(x, w), x.astype(np.float64) @ w_ref.T)
        _close(jax.jit(dense)(x, w, b), x.astype(np.float64) @ w_ref.T + b)
        xb = x.astype(ml_dtypes.bfloat16)  # exactly bfloat16 rows: the bfloat16 dot products where the build has them
        _close(jax.jit(dense)(xb, w), xb.astype(np.float64) @ w_ref.T)
    if fmt == "compact_bf16":  # 2-d only
        return
    # per head: a stack [H, N, K], x [H, R, K] -> [H, R, N] (each head's rows times its own weight)
    w, w_ref = random_weight(rng, (3, 100, model_dim), fmt)
    for rows in (1, 3, 11):
        x = rng.normal(size=(3, rows, model_dim)).astype(np.float32)
        _close(jax.jit(dense)(x, w), np.einsum("hrk,hnk->hrn", x.astype(np.float64), w_ref))
        _close(jax.jit(dense)(x, w, b[:100]), np.einsum("hrk,hnk->hrn", x.astype(np.float64), w_ref) + b[:100])
        xb = x.astype(ml_dtypes.bfloat16)
        _close(jax.jit(dense)(xb, w), np.einsum("hrk,hnk->hrn", xb.astype(np.float64), w_ref))


@needs_compiler
@pytest.mark.parametrize("glu", ["swiglu", "gpt_oss"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_moe_kernel_matches_float64_reference(fmt, shape, glu):
    args, kwargs, ref = _moe_case(fmt, shape, glu)
    _close(jax.jit(lambda *a: moe_experts(*a, **kwargs))(*args), ref)
    # one worker: the same sums (each output block is summed in expert order whatever the thread count)
    one = jax.jit(lambda *a: moe_experts(*a, **kwargs, max_workers=1))(*args)
    np.testing.assert_array_equal(np.asarray(one), np.asarray(jax.jit(lambda *a: moe_experts(*a, **kwargs))(*args)))


@needs_compiler
@pytest.mark.parametrize("fmt", DENSE_FORMATS)
def test_dense_kernel_matches_float64_reference(fmt):
    _check_dense(fmt)


@needs_compiler
@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_mul"])
def test_nvfp4_long_rows_with_every_kind_of_scale(fmt):
    """NVFP4 rows of 67 wide chunks + a 32 and a 16 tail (the kernel decodes scales 16 at a time, 64 chunks per
    pass: both passes, a vector and a scalar part), with zero and subnormal e4m3 scale codes among them."""
    rng = np.random.default_rng(2)
    model_dim = 128 * 67 + 32 + 16
    w, _ = random_weight(rng, (70, model_dim), fmt)
    codes = np.asarray(w.scale).view(np.uint8).copy()
    codes[:, ::7], codes[:, 3::11] = 0x00, 0x03  # zero, subnormal (3 x 2^-9)
    w = Nvfp4Weight(w.packed, jnp.asarray(codes.view(np.asarray(w.scale).dtype)), w.global_scale,
                    global_multiplies=w.global_multiplies)
    w_ref = np.asarray(w.dequantize(), np.float64)
    for rows in (1, 3):
        x = rng.normal(size=(rows, model_dim)).astype(np.float32)
        _close(jax.jit(dense)(x, w), x.astype(np.float64) @ w_ref.T)


@needs_compiler
def test_every_e4m3_code_decodes_exactly():
    check_e4m3_codes()


@needs_compiler
def test_every_per_channel_code_decodes_exactly():
    check_channel_codes()


@needs_compiler
def test_dense_leading_axes_and_errors():
    rng = np.random.default_rng(2)
    w, w_ref = random_weight(rng, (40, 64), "mxfp4")
    x = rng.normal(size=(2, 3, 64)).astype(np.float32)
    _close(dense(x, w), x.astype(np.float64) @ w_ref.T)
    with pytest.raises(ValueError, match=r"x \[..., 32\] does not match the weight's K=64"):
        dense(x[..., :32], w)
    with pytest.raises(ValueError, match=r"bias must be \[40\]"):
        dense(x, w, np.zeros(41, np.float32))
    with pytest.raises(ValueError, match="cannot read float16 weights"):
        dense(x, np.zeros((8, 64), np.float16))
    with pytest.raises(ValueError, match=r"a stack of 2 heads takes x \[2, R, 64\], got \[2, 3, 4, 64\]"):
        dense(x[:, :, None].repeat(4, 2), np.zeros((2, 8, 64), np.float32))
    with pytest.raises(ValueError, match="expected a 2-d weight or a 3-d stack of heads"):
        dense(x, np.zeros((1, 2, 8, 64), np.float32))


@needs_compiler
def test_moe_kernel_errors():
    args, kwargs, _ = _moe_case("mxfp4", "decode", "gpt_oss")
    x, ids, enc, dec, w1, w2 = args
    with pytest.raises(ValueError, match="glu must be one of"):
        moe_experts(*args, glu="relu")
    with pytest.raises(ValueError, match=r"b1 must be \[E=8, 192\]"):
        moe_experts(*args, b1=kwargs["b1"][:, :-1], glu="gpt_oss")
    with pytest.raises(ValueError, match=r"W1 must map M=192 to 2I=192 outputs"):
        moe_experts(x[:, :192], ids, enc, dec, w1, w2)


OTHER_ISAS = [isa for isa in build.cpu_isas() if isa != build.cpu_isas()[0]] if build.compiler() else []
# (ISA, extra compiler flags): every other ISA this CPU runs, and AVX-512 without its BF16 dot products where the
# CPU has them (the float32 path's compact bfloat16 decode differs there)
VARIANTS = [(isa, "") for isa in OTHER_ISAS]
if build.compiler() and build.cpu_isas()[0] == "avx512" and "avx512_bf16" in build._cpu_flags():
    VARIANTS.append(("avx512", "-mno-avx512bf16"))


@needs_compiler
@pytest.mark.parametrize("isa,cxxflags", VARIANTS)
def test_every_isa_this_cpu_runs_matches_reference(tmp_path, isa, cxxflags):
    """The kernels built for each other instruction set this CPU runs (TUTEL_JAX_NATIVE_ISA: AVX2 on an AVX-512
    machine, the portable C++ everywhere; TUTEL_JAX_NATIVE_CXXFLAGS: AVX-512 without BF16), apart, on the same
    checks as the best one in this process (the decode attention's too)."""
    env = dict(os.environ, TUTEL_JAX_NATIVE_ISA=isa, TUTEL_JAX_NATIVE_CXXFLAGS=cxxflags,
               TUTEL_JAX_CACHE=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
    code = ("import sys; sys.path[:0] = ['tests/native', 'tests']; import test_native_packed as t; "
            "import test_native_q8 as q; import test_native_attention as a; from tutel_jax import native; "
            "from tutel_jax.native import _build as b; "
            "t.check_kernels_against_reference(); q.check_q8_kernels(); a.check_attention_kernel(); "
            "print('isa', native.isa(), 'bf16', b.bf16_dot())")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"isa {isa} bf16 {isa == 'avx512' and not cxxflags}" in done.stdout
    assert len(list((tmp_path / "cache").glob("*.so"))) == 3  # moe_cpu, dense_cpu, attention_cpu: built for this run


def test_extra_compiler_flags_must_be_options(monkeypatch):
    monkeypatch.setenv("TUTEL_JAX_NATIVE_CXXFLAGS", "-O2 rm")
    with pytest.raises(build.NativeKernelError, match="TUTEL_JAX_NATIVE_CXXFLAGS: expected compiler options"):
        build.extra_flags()
    monkeypatch.setenv("TUTEL_JAX_NATIVE_CXXFLAGS", " -mno-avx512bf16  -DX=1 ")
    assert build.extra_flags() == ("-mno-avx512bf16", "-DX=1")


def test_cpu_isas_end_with_portable():
    """Every CPU runs the portable build; x86 lists AVX-512 before AVX2 (best first)."""
    isas = build.cpu_isas()
    assert isas[-1] == "portable" and set(isas) <= set(build.ISAS) and len(set(isas)) == len(isas)
    if "avx512" in isas and "avx2" in isas:
        assert isas.index("avx512") < isas.index("avx2")


TOP4 = {"type": "top", "k": 4}


@needs_compiler
@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp4", "nvfp4", "int8", "fp8_channel"])
@pytest.mark.parametrize("expert_type", ["swiglu", "gpt_oss"])
def test_layer_native_equals_loop_and_auto_picks_it(expert_type, fmt):
    experts = {"type": expert_type, "count_per_node": 16, "hidden_size_per_expert": 64, "weight_format": fmt}
    native = make_config(TOP4, 128, experts, dropless_impl="native")
    loop = make_config(TOP4, 128, experts, dropless_impl="loop")
    auto = make_config(TOP4, 128, experts)
    # CPU, packed experts: FP4 ones with int8 activations (test_native_q8), FP8 and per-channel ones with float32
    int8 = fmt in ("mxfp4", "nvfp4") and build.int8_pays_off()
    assert dropless.resolve_impl("auto", auto.experts, 8, 16) == ("native_int8" if int8 else "native")
    params = init_params(native, jax.random.key(0))
    for tokens in (3, 100):
        x = jax.random.normal(jax.random.key(tokens), (tokens, 128))
        y, _ = jax.jit(lambda p, x: moe_apply(p, x, native, capacity_factor=0.0))(params, x)
        ref, _ = jax.jit(lambda p, x: moe_apply(p, x, loop, capacity_factor=0.0))(params, x)
        _close(y, np.asarray(ref, np.float64))


_XLA: dict = {}


@needs_compiler
@pytest.mark.parametrize("case", ["gpt_oss_mxfp4", "qwen3_moe_nvfp4", "deepseek_v3_fp8", "gpt_oss"])
def test_fixture_models_native_equal_xla(case):
    """Every MoE layer and dense projection native: the XLA paths' logits (1e-5), and transformers' logits (the
    fixtures' 1e-4) and greedy tokens."""
    model = from_pretrained(HF / case, dropless_impl="native", dense_impl="native")
    xla = from_pretrained(HF / case, dropless_impl="loop", dense_impl="xla", attention_impl="xla")
    e = dict(np.load(HF / case / "expected.npz"))
    ids = jnp.asarray(e["input_ids"])
    ctx = context_from_mask(jnp.ones(ids.shape, bool))
    logits = np.asarray(model.apply(model.params, ids, ctx)[0])
    ref = np.asarray(xla.apply(xla.params, ids, ctx)[0])
    _close(logits, ref.astype(np.float64))
    np.testing.assert_allclose(logits, e["logits"], rtol=1e-4, atol=1e-4)
    # (the XLA path's own greedy tokens are checked against the fixtures in test_models_hf)
    np.testing.assert_array_equal(generate(model, e["input_ids"], 8).sequences, e["greedy"])


@needs_compiler
@pytest.mark.parametrize("k", [100, 2880])  # a partial last register of 32; gpt-oss-20b's hidden size
def test_dense_bfloat16_rows_against_float64(k):
    """A bfloat16 [N, K] weight times 1-8 rows: exactly-bfloat16 rows (a bfloat16 model's; with AVX-512 BF16 its
    dot products, `build.bf16_dot()`) and rows that are not (float32 FMAs) both give the float64 product at
    float32's accuracy (float32 sums of exact products)."""
    rng = np.random.default_rng(k)
    w = jnp.asarray(rng.normal(size=(96, k)), jnp.bfloat16)
    w64 = np.asarray(w, np.float64)
    for rows in range(1, 9):
        x32 = rng.normal(size=(rows, k)).astype(np.float32)
        for x in (np.asarray(jnp.asarray(x32, jnp.bfloat16), np.float32), x32):
            got = np.asarray(jax.jit(dense)(x, w), np.float64)
            want = x.astype(np.float64) @ w64.T
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max(),
                                       err_msg=f"{rows} rows, K={k}")


@needs_compiler
def test_dense_auto_rule():
    """'auto' takes the kernel for a few rows of a bfloat16 or packed weight on CPU, XLA otherwise."""
    from tutel_jax.native._dense import MAX_ROWS, worth_it
    bf16 = jnp.zeros((64, 32), jnp.bfloat16)
    packed = pallas_kernels.quantize_mxfp4(jnp.ones((32, 64)))
    assert worth_it(jnp.zeros((1, 1, 64)), bf16) and worth_it(jnp.zeros((MAX_ROWS, 64)), packed)
    assert not worth_it(jnp.zeros((MAX_ROWS + 1, 64)), bf16)  # a prefill: XLA's matmul
    assert not worth_it(jnp.zeros((1, 64)), jnp.zeros((64, 32), jnp.float32))
    assert not worth_it(jnp.zeros((1, 64)), jnp.zeros((64, 32), jnp.float16))
    with pytest.raises(ValueError, match="dense_impl must be one of"):
        from_pretrained(HF / "qwen3_moe", dense_impl="fast")
    bf = ml_dtypes.bfloat16  # the model in bfloat16: 'auto' decodes through the kernel, same greedy tokens
    e = dict(np.load(HF / "qwen3_moe" / "expected.npz"))
    auto = generate(from_pretrained(HF / "qwen3_moe", dtype=bf), e["input_ids"], 4).sequences
    xla = generate(from_pretrained(HF / "qwen3_moe", dtype=bf, dense_impl="xla", attention_impl="xla"),
                   e["input_ids"], 4).sequences
    assert auto.shape == xla.shape and (auto == xla).mean() >= 0.9
