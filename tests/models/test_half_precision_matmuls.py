"""The models' bfloat16 matmuls through XLA (`experts.matmul_out_in`: the dense projections and the lm_head of a
prefill) sum in float32 and round once, against a float64 NumPy product rounded the same way; their CPU programs
hold no float32 copy of an operand (XLA:CPU converts both operands of a bfloat16-result matmul to float32 in
memory, a whole weight per call); and XLA runs them at every size (a float32-result matmul of bfloat16 operands
has no fallback kernel on XLA:CPU where its fast library declines it)."""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tutel_jax.experts import linear, matmul_out_in

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


@pytest.mark.parametrize("rows", [1, 17, 512])
def test_bfloat16_matmuls_run_at_every_size(rows):
    rng = np.random.default_rng(rows)
    for k, n in itertools.product([8, 64, 2880], [8, 96, 5120]):
        x = jnp.asarray(rng.normal(size=(1, rows, k)), jnp.bfloat16)
        w = jnp.asarray(rng.normal(size=(n, k)), jnp.bfloat16)
        got = np.asarray(jax.jit(matmul_out_in)(x, w), np.float64)
        exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
        np.testing.assert_allclose(got, exact, rtol=2.0 ** -8, atol=1e-6 * k, err_msg=f"rows {rows}, k {k}, n {n}")
