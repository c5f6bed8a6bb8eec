"""Which implementation an op runs (`pallas_kernels._select`): the explicit name, the environment, the platform
the program is compiled for, and the fallback when a kernel declines a call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from pallas_kernels import _select
from pallas_kernels.gating import MAX_KERNEL_EXPERTS

from support.kernels import random_normal



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
