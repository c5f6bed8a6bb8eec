"""Every kernel lowers for CUDA and ROCm on this CPU machine (jax.export with the Triton custom call allowed).

This proves the Triton backend accepts each kernel (shapes, dtypes -- fp8 and uint8-packed fp4 included --,
masks, gathers, loops); only a GPU proves it compiles and runs (benchmarks/gpu_kernels.py). Shapes here are
realistic (bf16, hundreds of tokens, 64-256 experts) and use the default tilings, i.e. what a GPU would run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk

TRITON_CALL = "__gpu$xla.gpu.triton"
SDS = jax.ShapeDtypeStruct
F32, BF16, I32 = jnp.float32, jnp.bfloat16, jnp.int32
S, E, M, K, N, G = 300, 64, 256, 512, 384, 8


def _quantized(fmt: str, shape):
    quantize = {"fp8_block": pk.quantize_fp8_block, "mxfp4": pk.quantize_mxfp4, "nvfp4": pk.quantize_nvfp4}[fmt]
    return jax.eval_shape(quantize, SDS(shape, F32))


def _cases():
    k = 2
    slots = SDS((k, S), I32)
    cases = {
        "gating_softmax": (lambda l: pk.gating(l, 4, implementation="pallas"), [SDS((S, E), BF16)], 2),
        "gating_sigmoid_grouped": (
            lambda l, b: pk.gating(l, 8, score_fn="sigmoid", correction_bias=b, n_group=8, topk_group=4,
                                   implementation="pallas"), [SDS((S, 256), F32), SDS((256,), F32)], 2),
        "slot_positions": (lambda i: pk.slot_positions(i, E, implementation="pallas"), [slots], 2),
        "encode": (lambda x, w, s: pk.encode(x, w, s, E * 16, implementation="pallas"),
                   [SDS((S, M), BF16), SDS((k, S), F32), slots], 1),
        "decode": (lambda d, w, s: pk.decode(d, w, s, implementation="pallas"),
                   [SDS((E * 16, M), BF16), SDS((k, S), F32), slots], 1),
        "encode_vjp": (lambda x, w, s: jax.grad(
            lambda x, w: jnp.sum(pk.encode(x, w, s, E * 16, implementation="pallas").astype(F32)), (0, 1))(x, w),
            [SDS((S, M), BF16), SDS((k, S), F32), slots], 2),  # decode kernel + row-dots kernel
        "gmm": (lambda a, b, g: pk.gmm(a, b, g, implementation="pallas"),
                [SDS((S, K), BF16), SDS((G, K, N), BF16), SDS((G,), I32)], 1),
        "gmm_vjp": (lambda a, b, g: jax.grad(
            lambda a, b: jnp.sum(pk.gmm(a, b, g, implementation="pallas").astype(F32)), (0, 1))(a, b),
            [SDS((S, K), BF16), SDS((G, K, N), BF16), SDS((G,), I32)], 2),  # gmm (transposed rhs) + tgmm
        "gmm_f32_transposed": (lambda a, b, g: pk.gmm(a, b, g, transpose_rhs=True, implementation="pallas"),
                               [SDS((S, K), F32), SDS((G, N, K), F32), SDS((G,), I32)], 1),
        "tgmm": (lambda a, b, g: pk.tgmm(a, b, g, implementation="pallas"),
                 [SDS((S, K), BF16), SDS((S, N), BF16), SDS((G,), I32)], 1),
    }
    for fmt in ("fp8_block", "mxfp4", "nvfp4"):
        cases[f"quant_matmul_decode_{fmt}"] = (  # M = 8: split-K
            lambda x, w: pk.quant_matmul(x, w, implementation="pallas"), [SDS((8, K), BF16), _quantized(fmt, (N, K))], 1)
        cases[f"quant_gmm_{fmt}"] = (
            lambda x, w, g: pk.quant_gmm(x, w, g, implementation="pallas"),
            [SDS((S, K), BF16), _quantized(fmt, (G, N, K)), SDS((G,), I32)], 1)
    modelopt = _quantized("nvfp4", (G, N, K))  # ModelOpt: the global scale multiplies the accumulator
    cases["quant_gmm_nvfp4_modelopt"] = (
        lambda x, w, g: pk.quant_gmm(x, w, g, implementation="pallas"),
        [SDS((S, K), F32), type(modelopt)(modelopt.packed, modelopt.scale, modelopt.global_scale, True),
         SDS((G,), I32)], 1)
    return cases


CASES = _cases()


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_lowers(name, platform):
    fn, args, num_kernels = CASES[name]
    exported = jax.export.export(
        jax.jit(fn), platforms=[platform],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args)
    text = exported.mlir_module()
    assert text.count(TRITON_CALL) == num_kernels, f"{name}: expected {num_kernels} Triton kernels"


def test_auto_exports_plain_xla_on_cpu(monkeypatch):
    """The default ("auto") resolves at trace time on this CPU host: no Triton call, so CPU users are unaffected."""
    monkeypatch.delenv(pk.ENV_VAR, raising=False)
    fn, args, _ = CASES["gmm"]
    exported = jax.export.export(jax.jit(lambda a, b, g: pk.gmm(a, b, g)), platforms=["cpu"])(*args)
    assert TRITON_CALL not in exported.mlir_module()
