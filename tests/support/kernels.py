"""The shared test base of every pallas_kernels op (tokamax style).

Every op test class derives from `KernelTestBase` and runs each test for every backend of its `BACKENDS`:
"xla" (the reference through the op's dispatcher and custom VJPs), "interpret" (the Pallas Triton kernel through
Pallas' CPU interpreter) and, for ops with a Mosaic TPU kernel, "tpu_interpret". No test needs a GPU. Interpret
mode is slow: shapes stay small (T <= 256, K, N <= 256), every call is jitted once, and each test compiles few
kernel variants.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest


IMPLEMENTATIONS = ("xla", "interpret")

# max |actual - expected| / max(1, max |expected|) per compute dtype: float32 kernels differ from the
# references only by summation order; bf16 outputs are rounded once (kernel) vs per step (reference).
TOLERANCE = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 2e-2}


def assert_close(actual, expected, dtype=jnp.float32, tol: float | None = None):
    actual = np.asarray(jnp.asarray(actual, jnp.float32))
    expected = np.asarray(jnp.asarray(expected, jnp.float32))
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert np.all(np.isfinite(actual) == np.isfinite(expected)), "non-finite values differ"
    tol = TOLERANCE[jnp.dtype(dtype)] if tol is None else tol
    scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    err = float(np.max(np.abs(actual - expected), initial=0.0))
    assert err <= tol * scale, f"max error {err:.3g} > {tol:.1g} * {scale:.3g}"


def random_normal(seed: int, shape, dtype=jnp.float32, scale: float = 1.0) -> jax.Array:
    """Fresh random values (never zeros: a kernel that writes nothing must fail)."""
    return jnp.asarray(np.random.RandomState(seed).randn(*shape) * scale, jnp.float32).astype(dtype)


class KernelTestBase:
    """Base of every op test: each test runs once per backend in `BACKENDS` (tests/conftest.py parametrizes
    `kernel_impl` from it), and `self.call(op, *args, **kw)` runs op under jit with that implementation. An op
    with a Mosaic TPU kernel adds "tpu_interpret" (the Mosaic kernel through Pallas' TPU interpreter)."""

    #: the implementations every test of the class runs
    BACKENDS: tuple[str, ...] = IMPLEMENTATIONS
    impl: str

    @pytest.fixture(autouse=True)
    def _implementation(self, kernel_impl):
        self.impl = kernel_impl

    def call(self, op, *args, static: dict | None = None, **kwargs):
        """jit(op)(*args) with `implementation=self.impl`; `static` kwargs are closed over (not traced)."""
        fn = partial(op, implementation=self.impl, **(static or {}))
        return jax.jit(fn)(*args, **kwargs)
