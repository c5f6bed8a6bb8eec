"""Shared test base for pallas_kernels (tokamax style) and the implementation-selection tests.

Every op test class derives from `KernelTestBase` and is parametrised over `IMPLEMENTATIONS`: "xla" (the
reference through the op's dispatcher and custom VJPs) and "interpret" (the Pallas kernel through Pallas' CPU
interpreter). No test needs a GPU. Interpret mode is slow: shapes stay small (T <= 256, K, N <= 256), every call
is jitted once, and each test compiles few kernel variants.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import _select
from pallas_kernels.gating import MAX_KERNEL_EXPERTS

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
    """Base of every op test: `self.call(op, *args, **kw)` runs op under jit with the class's implementation."""

    impl: str

    @pytest.fixture(autouse=True, params=IMPLEMENTATIONS)
    def _implementation(self, request):
        self.impl = request.param

    def call(self, op, *args, static: dict | None = None, **kwargs):
        """jit(op)(*args) with `implementation=self.impl`; `static` kwargs are closed over (not traced)."""
        fn = partial(op, implementation=self.impl, **(static or {}))
        return jax.jit(fn)(*args, **kwargs)


# ---------------------------------------------------------------------------------------------- selection


def test_auto_on_cpu_is_xla(monkeypatch):
    monkeypatch.delenv(pk.ENV_VAR, raising=False)
    assert pk.resolve("auto") == ("xla",)
    assert pk.resolve(None) == ("xla",)
    assert pk.resolved_name() == "xla"


def test_explicit_choice_and_aliases(monkeypatch):
    monkeypatch.setenv(pk.ENV_VAR, "xla")
    assert pk.resolve("pallas") == ("pallas",)  # an explicit argument beats the environment
    assert pk.resolve("Triton") == ("pallas",)
    assert pk.resolve("interpret") == ("interpret",)
    with pytest.raises(ValueError, match="implementation"):
        pk.resolve("cuda")


def test_environment_variable(monkeypatch):
    monkeypatch.setenv(pk.ENV_VAR, "interpret")
    assert pk.resolve("auto") == ("interpret",)
    monkeypatch.setenv(pk.ENV_VAR, "auto")
    assert pk.resolve("auto") == ("xla",)
    monkeypatch.setenv(pk.ENV_VAR, "bogus")
    with pytest.raises(ValueError, match=pk.ENV_VAR):
        pk.resolve("auto")


def test_auto_on_gpu_tries_kernel_then_falls_back(monkeypatch):
    monkeypatch.delenv(pk.ENV_VAR, raising=False)
    monkeypatch.setattr(_select, "compile_platform", lambda: "gpu")
    assert pk.resolve("auto") == ("pallas", "xla")

    def unsupported():
        raise pk.NotSupported("too big")

    assert pk.choose("auto", unsupported) == "xla"  # auto falls back
    assert pk.choose("auto", lambda: None) == "pallas"
    with pytest.raises(pk.NotSupported):
        pk.choose("pallas", unsupported)  # an explicit kernel choice does not


def test_environment_selects_the_kernel_for_an_op(monkeypatch):
    """TUTEL_JAX_KERNELS=interpret makes a default call run the kernel (its name shows in the jaxpr)."""
    x = random_normal(0, (8, 16))
    w = random_normal(1, (2, 16, 16))
    sizes = jnp.asarray([3, 5], jnp.int32)
    monkeypatch.setenv(pk.ENV_VAR, "interpret")
    assert "pallas_call" in str(jax.make_jaxpr(lambda a, b: pk.gmm(a, b, sizes))(x, w))
    monkeypatch.setenv(pk.ENV_VAR, "xla")
    assert "pallas_call" not in str(jax.make_jaxpr(lambda a, b: pk.gmm(a, b, sizes))(x, w))


def test_gating_falls_back_for_too_many_experts(monkeypatch):
    monkeypatch.setattr(_select, "compile_platform", lambda: "gpu")
    logits = random_normal(0, (4, MAX_KERNEL_EXPERTS + 1))
    jaxpr = str(jax.make_jaxpr(lambda l: pk.gating(l, 2).expert_ids)(logits))
    assert "pallas_call" not in jaxpr
    with pytest.raises(pk.NotSupported):
        jax.make_jaxpr(lambda l: pk.gating(l, 2, implementation="pallas").expert_ids)(logits)


def test_registry_lists_every_op():
    assert set(pk.OPS) == {"gating", "slot_positions", "encode", "decode", "gmm", "tgmm", "quant_matmul",
                           "quant_gmm"}
    for op, reference in pk.OPS.values():
        assert callable(op) and callable(reference)


@pytest.mark.parametrize("name, kwargs", [
    ("GmmConfig", dict(block_m=24)), ("GmmConfig", dict(block_k=8)), ("DispatchConfig", dict(block_rows=3)),
    ("GatingConfig", dict(block_tokens=4))])
def test_configs_reject_bad_blocks(name, kwargs):
    with pytest.raises(ValueError, match="power of two"):
        getattr(pk, name)(**kwargs)
