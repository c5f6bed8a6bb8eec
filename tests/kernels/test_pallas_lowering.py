"""Every kernel lowers for each GPU target on this CPU machine (jax.export with the Triton custom call allowed).

Targets: sm_80 (A100) and sm_90 (H100/H200) lower for CUDA, gfx942 (MI300) for ROCm, each under
`pallas_kernels.lowering_context`, which selects the target's tilings and code paths (no e4m3 conversion on
sm_80) and gives JAX 0.11+ the abstract GPU it asks for. This proves the Triton backend accepts each kernel
(shapes, dtypes -- fp8 and uint8-packed fp4 included --, masks, gathers, loops); tests/kernels/test_pallas_compile.py
compiles the kernels with triton for each architecture; only a GPU proves they run (benchmarks/gpu_check.py).
Shapes here are realistic (bf16, hundreds of tokens, 64-256 experts) and use the default tilings.
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
    return jax.eval_shape(pk.quant.FORMATS[fmt].quantize, SDS(shape, F32))


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
    for fmt in pk.quant.FORMATS:
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


def _export(name: str, target: str) -> str:
    fn, args, _ = CASES[name]
    with pk.lowering_context(target) as t:
        exported = jax.export.export(
            jax.jit(lambda *a: fn(*a)), platforms=[t.platform],  # a fresh function: jit caches ignore the target
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args)
    return exported.mlir_module()


@pytest.mark.parametrize("target", sorted(pk.TARGETS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_lowers(name, target):
    num_kernels = CASES[name][2]
    assert _export(name, target).count(TRITON_CALL) == num_kernels, f"{name}: expected {num_kernels} Triton kernels"


@pytest.mark.parametrize("name", [n for n in sorted(CASES) if "fp8" in n or "nvfp4" in n])
def test_sm80_kernels_convert_no_e4m3(name):
    """A100 has no e4m3 conversion: its kernels take the e4m3 bytes as uint8 and decode them with integer ops;
    H100 kernels convert in hardware (the e4m3 type appears in their Triton modules)."""
    from pallas_kernels.offline import triton_kernels

    def e4m3_in_kernels(target):
        return any("f8E4M3FN" in k.ttir for k in triton_kernels(_export(name, target)))

    assert not e4m3_in_kernels("sm_80")
    assert e4m3_in_kernels("sm_90")


def test_auto_exports_plain_xla_on_cpu(monkeypatch):
    """The default ("auto") resolves at trace time on this CPU host: no Triton call, so CPU users are unaffected."""
    monkeypatch.delenv(pk.ENV_VAR, raising=False)
    fn, args, _ = CASES["gmm"]
    exported = jax.export.export(jax.jit(lambda a, b, g: pk.gmm(a, b, g)), platforms=["cpu"])(*args)
    assert TRITON_CALL not in exported.mlir_module()


@pytest.mark.parametrize("cf", [1.0, 0.0])
def test_expert_parallel_layer_runs_kernels_inside_shard_map(cf):
    """The expert-parallel layer with kernel_backend="pallas" lowers for CUDA with its kernels inside shard_map
    (check_vma on): the kernels' outputs take the operands' varying mesh axes. Forward and gradients.
    (Pallas' interpreter cannot run inside shard_map with check_vma, so this is proven by lowering.)"""
    import numpy as np
    from jax.sharding import Mesh

    from tutel_jax import init_params, make_config
    from tutel_jax.parallel import ExpertParallel, moe_apply_parallel, shard_params

    placement = ExpertParallel(Mesh(np.array(jax.devices()[:1]), ("expert",)))
    config = make_config({"type": "top", "k": 2, "capacity_factor": cf}, 64,
                         {"type": "ffn", "count_per_node": 4, "hidden_size_per_expert": 64}, world_size=1,
                         kernel_backend="pallas")
    params = shard_params(init_params(config, jax.random.key(0)), placement, config)

    def loss(p, x):
        y, aux = moe_apply_parallel(p, x, config, placement)
        return jnp.sum(y) + aux.l_aux

    x = jnp.ones((2, 16, 64), jnp.float32)
    try:
        with pk.use_target("sm_90"):  # the layer's own mesh: no abstract GPU mesh can surround it
            exported = jax.export.export(
                jax.jit(jax.grad(loss, argnums=(0, 1))), platforms=["cuda"],
                disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(params, x)
    except Exception as error:  # JAX 0.11+ asks the device for its compute capability while lowering
        if "No supported GPU devices found" not in str(error):
            raise
        pytest.skip("this JAX lowers Triton kernels only on a GPU or under an abstract GPU mesh, which a layer "
                    "sharded over a concrete CPU mesh cannot have (JAX 0.10 runs this test)")
    text = exported.mlir_module()
    assert text.count(TRITON_CALL) >= 4  # gating, dispatch, expert matmuls and their backward kernels
