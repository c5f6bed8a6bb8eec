"""Quantized formats (NumPy-exact reference dequantizers, bit decoders, quantizers) and the quantized matmuls
(dense and per-expert) against dequantize-then-matmul."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import quant

from support.kernels import KernelTestBase, assert_close, random_normal

LUT = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
RNG = np.random.RandomState(1234)


# ------------------------------------------------------------- NumPy transcriptions of the fixtures README


def np_fp8_block(weight: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    out_dim, in_dim = weight.shape[-2:]
    scale = np.repeat(np.repeat(scale_inv, 128, axis=-2), 128, axis=-1)[..., :out_dim, :in_dim]
    return weight.astype(np.float32) * scale.astype(np.float32)


def np_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    lo, hi = LUT[blocks & 0x0F], LUT[blocks >> 4]
    values = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], 32)  # [.., out, in/32, 32]
    factor = (2.0 ** (scales.astype(np.float64) - 127)).astype(np.float32)  # scales read UNSIGNED
    w = values * factor[..., None]
    return w.reshape(*w.shape[:-2], -1)


def np_nvfp4(packed: np.ndarray, scale: np.ndarray, global_scale: np.ndarray) -> np.ndarray:
    code = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    block = scale.astype(np.float32) / global_scale.astype(np.float32)[..., None]  # divide first, float32
    return LUT[code] * np.repeat(block, 16, axis=-1)


def _random_fp8(shape) -> np.ndarray:
    values = RNG.randn(*shape).astype(np.float32) * 100
    return np.clip(values, -448, 448).astype(ml_dtypes.float8_e4m3fn)


def test_bit_decoders_are_exact():
    codes = np.arange(16)
    np.testing.assert_array_equal(np.asarray(quant.e2m1_to_f32(jnp.asarray(codes))).view(np.uint32),
                                  LUT.view(np.uint32))  # including -0.0
    s = np.arange(255, dtype=np.uint8)  # 255 (NaN in the OCP spec) is left out
    expected = (2.0 ** (s.astype(np.float64) - 127)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(quant.e8m0_to_f32(jnp.asarray(s))), expected)


def test_e4m3_bit_decoder_is_exact_for_every_code():
    """All 256 float8_e4m3fn patterns (subnormals, both zeros, NaNs) decode as ml_dtypes converts them."""
    bits = np.arange(256, dtype=np.uint8)
    expected = bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = np.asarray(jax.jit(quant.e4m3_to_f32)(jnp.asarray(bits)))
    finite = ~np.isnan(expected)
    assert int(finite.sum()) == 254  # 0x7F and 0xFF are the only NaNs
    np.testing.assert_array_equal(got[finite].view(np.uint32), expected[finite].view(np.uint32))  # -0.0 too
    assert np.all(np.isnan(got[~finite]))


def test_dequant_fp8_block_numpy_exact():
    weight = _random_fp8((2, 200, 300))  # edge blocks partial in both dims, a leading expert dim
    scale_inv = RNG.rand(2, 2, 3).astype(np.float32)
    got = pk.dequant_fp8_block(jnp.asarray(weight), jnp.asarray(scale_inv))
    np.testing.assert_array_equal(np.asarray(got), np_fp8_block(weight, scale_inv))


def test_dequant_mxfp4_numpy_exact():
    blocks = RNG.randint(0, 256, (3, 10, 4, 16)).astype(np.uint8)
    scales = RNG.randint(100, 190, (3, 10, 4)).astype(np.uint8)  # >= 128 must not read as negative
    got = pk.dequant_mxfp4(jnp.asarray(blocks), jnp.asarray(scales))
    np.testing.assert_array_equal(np.asarray(got), np_mxfp4(blocks, scales))
    assert got.shape == (3, 10, 128)


def test_dequant_nvfp4_numpy_exact():
    packed = RNG.randint(0, 256, (2, 12, 24)).astype(np.uint8)
    scale = np.abs(_random_fp8((2, 12, 3)))
    global_scale = (RNG.rand(2, 1) * 1000 + 1).astype(np.float32)
    got = pk.dequant_nvfp4(jnp.asarray(packed), jnp.asarray(scale), jnp.asarray(global_scale))
    np.testing.assert_array_equal(np.asarray(got), np_nvfp4(packed, scale, global_scale))
    # a single weight with a [1] global scale
    got = pk.dequant_nvfp4(jnp.asarray(packed[0]), jnp.asarray(scale[0]), jnp.asarray(global_scale[0]))
    np.testing.assert_array_equal(np.asarray(got), np_nvfp4(packed[0], scale[0], global_scale[0]))


def test_low_nibble_is_the_even_element():
    blocks = np.zeros((1, 1, 16), np.uint8)
    blocks[0, 0, 0] = 0x72  # low nibble 2 (1.0) -> element 0, high nibble 7 (6.0) -> element 1
    w = np.asarray(pk.dequant_mxfp4(jnp.asarray(blocks), jnp.full((1, 1), 127, jnp.uint8)))
    assert (w[0, 0], w[0, 1]) == (1.0, 6.0)


@pytest.mark.parametrize("quantize, tol", [(pk.quantize_fp8_block, 0.07), (pk.quantize_mxfp4, 0.2),
                                           (pk.quantize_nvfp4, 0.2), (pk.quantize_int8, 0.5 / 127),
                                           (pk.quantize_fp8_channel, 0.07)])
def test_quantizers_round_trip(quantize, tol):
    w = random_normal(0, (2, 48, 160))
    q = jax.jit(quantize)(w)
    assert q.shape == (2, 48, 160)
    err = float(jnp.max(jnp.abs(q.dequantize() - w)) / jnp.max(jnp.abs(w)))
    assert err < tol


# ------------------------------------------------------------------------------------------------ kernels

# jitted: one compile instead of many eager ops
FORMATS = {name: jax.jit(fmt.quantize) for name, fmt in pk.quant.FORMATS.items()}
SMALL = pk.GmmConfig(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=1)
SPLIT = pk.GmmConfig(block_m=16, block_n=32, block_k=32, split_k=2, num_warps=4, num_stages=1)


class TestQuantMatmul(KernelTestBase):
    @pytest.mark.parametrize("fmt", FORMATS)
    @pytest.mark.parametrize("rows, dtype, config", [
        (5, jnp.float32, SMALL),     # decode-sized, K tail of half a block for FP8 (192 = 3 x 64)
        (3, jnp.bfloat16, SPLIT),    # split-K partials summed in XLA
    ])
    def test_dense(self, fmt, rows, dtype, config):
        w = FORMATS[fmt](random_normal(1, (40, 192)))  # N = 40: a partial N tile
        x = random_normal(rows, (rows, 192), dtype)
        out = self.call(pk.quant_matmul, x, w, static=dict(config=config))
        assert out.dtype == dtype
        assert_close(out, jax.jit(partial(pk.quant_matmul_reference, out_dtype=jnp.float32))(x, w), dtype)

    @pytest.mark.parametrize("fmt", FORMATS)
    def test_grouped(self, fmt):
        w = FORMATS[fmt](random_normal(2, (3, 24, 128)))
        x = random_normal(3, (25, 128))
        sizes = jnp.asarray([7, 0, 12], jnp.int32)  # an empty expert; 6 rows past the sum -> zeros
        out = self.call(pk.quant_gmm, x, w, sizes, static=dict(config=SMALL))
        assert_close(out, jax.jit(pk.quant_gmm_reference)(x, w, sizes))
        assert not np.any(np.asarray(out[19:]))

    def test_fp8_block_scales_per_128_block(self):
        """K = 256 and N = 160: two scale blocks along K and a partial second block along N."""
        w = FORMATS["fp8_block"](random_normal(4, (160, 256)) * jnp.linspace(0.1, 10, 256)[None, :])
        x = random_normal(5, (4, 256), jnp.bfloat16)
        out = self.call(pk.quant_matmul, x, w, static=dict(config=SMALL))
        assert_close(out, jax.jit(partial(pk.quant_matmul_reference, out_dtype=jnp.float32))(x, w), jnp.bfloat16)


def _pallas_operand_dtypes(fn, *args) -> list:
    """Dtypes of the operands of every pallas_call in fn's jaxpr (nested jaxprs included)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found.extend(v.aval.dtype for v in eqn.invars)
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.parametrize("fmt", ["fp8_block", "nvfp4", "nvfp4_modelopt", "fp8_channel"])
def test_e4m3_bit_path_of_targets_without_fp8_hardware(fmt):
    """Traced for sm_80 (no e4m3 conversion), the kernels read e4m3 weights / scales as uint8 bit patterns and
    decode them with integer operations; the result matches the reference as on the other targets."""
    w = FORMATS["nvfp4" if fmt.startswith("nvfp4") else fmt](random_normal(2, (3, 24, 128)))
    if fmt == "nvfp4_modelopt":
        w = pk.Nvfp4Weight(w.packed, w.scale, 1.0 / w.global_scale, True)
    x = random_normal(3, (25, 128), jnp.bfloat16)
    sizes = jnp.asarray([7, 0, 12], jnp.int32)
    # a new function per target: jax.jit caches traces by shapes, not by the target context
    run = lambda x, w, g: pk.quant_gmm(x, w, g, implementation="interpret", config=SMALL, out_dtype=jnp.float32)
    with pk.use_target("sm_80"):
        operands = _pallas_operand_dtypes(run, x, w, sizes)
        out = jax.jit(run)(x, w, sizes)
    assert jnp.uint8 in operands and jnp.float8_e4m3fn not in operands, operands
    with pk.use_target("sm_90"):  # hardware conversion: the e4m3 array goes in as it is
        assert jnp.float8_e4m3fn in _pallas_operand_dtypes(lambda *a: run(*a), x, w, sizes)
    assert_close(out, jax.jit(partial(pk.quant_gmm_reference, out_dtype=jnp.float32))(x, w, sizes), jnp.bfloat16)


def test_fp8_kernel_rejects_block_k_not_dividing_128():
    w = pk.quantize_fp8_block(random_normal(0, (32, 512)))
    bad = pk.GmmConfig(block_m=16, block_n=32, block_k=256)
    with pytest.raises(pk.NotSupported):
        pk.quant_matmul(random_normal(1, (2, 512)), w, implementation="interpret", config=bad)
