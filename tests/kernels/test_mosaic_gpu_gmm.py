"""The Mosaic GPU grouped matmul (tokamax's ragged_dot on sm_90 / sm_100): selection, and the compiled program.

Selection runs everywhere (the target and tokamax's presence are patched where needed). The compile tests need
jax >= 0.12 with the CUDA plugin and tokamax (Python >= 3.12): a jitted program calling `pallas_kernels.gmm`
with its default implementation, compiled deviceless for an H100 and for a B200, holds tokamax's Mosaic GPU
kernel (custom call `mosaic_gpu_v2`), forward and backward. Mosaic GPU keeps one architecture per process when
compiling without a GPU, so each target compiles in a child process.

Numerics: Mosaic GPU kernels run only on a GPU (no interpreter runs them, and tokamax has no interpret mode for
them), so they are checked against `gmm_reference` on a device by `benchmarks/gpu_kernels.py`
(checks gmm_mosaic_gpu_bfloat16 and gmm_mosaic_gpu_float32: bf16 operands with a float32 output); the semantics this module adds around the kernel
(clamped group sizes, padded and masked rows) are exercised here by the compile of such shapes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from pallas_kernels import _select
from pallas_kernels.gmm import _pallas_mosaic_gpu as mosaic_gpu_gmm
from support.paths import REPO

SDS = jax.ShapeDtypeStruct


@pytest.fixture(autouse=True)
def _no_environment_choice(monkeypatch):
    monkeypatch.delenv(pk.ENV_VAR, raising=False)


def _gmm_check():
    """The Mosaic GPU gmm's own check for a call it takes (bf16, K and N multiples of 64)."""
    mosaic_gpu_gmm.check_supported(jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, 512, 384)


def _gpu_program(monkeypatch, target: str, tokamax: bool):
    """Trace as a GPU program for `target`, with tokamax present (its kernel check passing) or missing."""
    monkeypatch.setattr(_select, "compile_platform", lambda: "gpu")
    monkeypatch.setattr(mosaic_gpu_gmm, "unavailable_reason",
                        lambda: None if tokamax else "tokamax is not installed (test)")
    return pk.use_target(target)


# ------------------------------------------------------------------------------------------------- selection


@pytest.mark.parametrize("target", ["sm_90", "sm_100"])
def test_mosaic_gpu_is_asked_for_by_name_on_hopper_and_blackwell(monkeypatch, target):
    """"auto" keeps Triton first even with tokamax (slower at prefill sizes on an H200, see _select.py);
    the name picks the Mosaic GPU kernel."""
    with _gpu_program(monkeypatch, target, tokamax=True):
        assert pk.resolve("auto", mosaic_gpu=True) == ("pallas", "xla")
        assert pk.choose("auto", mosaic_gpu=True) == "pallas"
        assert pk.choose("mosaic_gpu", mosaic_gpu=lambda: None) == "mosaic_gpu"
        assert pk.resolve("auto") == ("pallas", "xla") and pk.choose("auto") == "pallas"


@pytest.mark.parametrize("target", ["sm_80", "gfx942"])
def test_auto_keeps_triton_elsewhere(monkeypatch, target):
    with _gpu_program(monkeypatch, target, tokamax=True):
        assert pk.resolve("auto", mosaic_gpu=True) == ("pallas", "xla")
        assert pk.choose("auto", mosaic_gpu=True) == "pallas"
        with pytest.raises(pk.NotSupported, match=f"target sm_90 and sm_100; this program is traced for {target}"):
            pk.choose("mosaic_gpu", mosaic_gpu=_gmm_check)


@pytest.mark.parametrize("target", ["sm_90", "sm_100"])
def test_auto_keeps_triton_without_tokamax(monkeypatch, target):
    with _gpu_program(monkeypatch, target, tokamax=False):
        assert pk.resolve("auto", mosaic_gpu=True) == ("pallas", "xla")
        assert pk.choose("auto", mosaic_gpu=True) == "pallas"
        with pytest.raises(pk.NotSupported, match="tokamax is not installed"):
            pk.choose("mosaic_gpu", mosaic_gpu=_gmm_check)


def test_a_declining_mosaic_gpu_check_falls_back_to_triton(monkeypatch):
    def decline():
        raise pk.NotSupported("float32 operands")

    with _gpu_program(monkeypatch, "sm_90", tokamax=True):
        with pytest.raises(pk.NotSupported, match="float32 operands"):
            pk.choose("mosaic_gpu", mosaic_gpu=decline)


def test_ops_without_a_mosaic_gpu_kernel_refuse_it(monkeypatch):
    with _gpu_program(monkeypatch, "sm_90", tokamax=True):
        with pytest.raises(pk.NotSupported, match="no Mosaic GPU kernel"):
            pk.choose("mosaic_gpu")
    assert pk.resolve("mosaic_gpu") == ("mosaic_gpu",)  # an explicit name is taken as it is


def test_cpu_programs_stay_plain_xla(monkeypatch):
    monkeypatch.setattr(mosaic_gpu_gmm, "unavailable_reason", lambda: None)
    assert pk.resolve("auto", mosaic_gpu=True) == ("xla",)


def test_environment_variable_names_mosaic_gpu(monkeypatch):
    monkeypatch.setenv(pk.ENV_VAR, "mosaic_gpu")
    assert pk.resolve("auto", mosaic_gpu=True) == ("mosaic_gpu",)
    assert pk.resolve("pallas", mosaic_gpu=True) == ("pallas",)  # call > environment


def test_real_tokamax_status_is_consistent():
    """This environment's answer: tokamax importable exactly when no reason is given."""
    reason = mosaic_gpu_gmm.unavailable_reason()
    try:
        import tokamax  # noqa: F401
        present = True
    except ImportError:
        present = False
    assert (reason is None) == present, reason
    if not present:
        assert "pip install tokamax" in reason


def test_gmm_declines_calls_the_kernel_cannot_take(monkeypatch):
    """The op-level check: the target, dtypes, widths, sm_100's output dtype, a partitioned mesh."""
    monkeypatch.setattr(mosaic_gpu_gmm, "unavailable_reason", lambda: None)
    monkeypatch.setattr(mosaic_gpu_gmm, "_tokamax", lambda: None)
    monkeypatch.setattr(mosaic_gpu_gmm, "compile_device", lambda target=None: object())
    bf16, f32 = jnp.bfloat16, jnp.float32
    check = mosaic_gpu_gmm.check_supported
    with pk.use_target("sm_90"):
        check(bf16, bf16, bf16, 512, 384)
        check(bf16, bf16, f32, 512, 384)
        for args, message in [((f32, f32, f32, 512, 384), "two bfloat16 or two float16"),
                              ((bf16, f32, f32, 512, 384), "two bfloat16 or two float16"),
                              ((bf16, bf16, jnp.int32, 512, 384), "writes"),
                              ((bf16, bf16, bf16, 200, 384), "multiples of 64"),
                              ((bf16, bf16, bf16, 512, 72), "multiples of 64")]:
            with pytest.raises(pk.NotSupported, match=message):
                check(*args)
    with pk.use_target("sm_100"):
        check(bf16, bf16, bf16, 512, 384)
        with pytest.raises(pk.NotSupported, match="writes"):
            check(bf16, bf16, f32, 512, 384)
    with pk.use_target("sm_80"), pytest.raises(pk.NotSupported, match="traced for sm_80"):
        check(bf16, bf16, bf16, 512, 384)
    mesh = jax.sharding.AbstractMesh((2,), ("x",))
    with pk.use_target("sm_90"), jax.sharding.use_abstract_mesh(mesh):
        with pytest.raises(pk.NotSupported, match="cannot be partitioned"):
            check(bf16, bf16, bf16, 512, 384)


def test_no_device_to_build_for_is_not_supported(monkeypatch):
    monkeypatch.setattr(mosaic_gpu_gmm, "unavailable_reason", lambda: None)
    monkeypatch.setattr(mosaic_gpu_gmm, "_tokamax", lambda: None)
    monkeypatch.setattr(mosaic_gpu_gmm, "compile_device", lambda target=None: None)
    with pk.use_target("sm_90"), pytest.raises(pk.NotSupported, match="no sm_90 device"):
        mosaic_gpu_gmm.check_supported(jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, 512, 384)


def test_gmm_auto_is_triton_on_hopper(monkeypatch):
    """gmm traced for sm_90 with tokamax present: "auto" holds the Triton kernels, forward and backward."""
    monkeypatch.setattr(mosaic_gpu_gmm, "unavailable_reason", lambda: None)
    monkeypatch.setattr(_select, "compile_platform", lambda: "gpu")
    args = (SDS((64, 128), jnp.float32), SDS((4, 128, 64), jnp.float32), SDS((4,), jnp.int32))
    loss = lambda a, b, g: jnp.sum(pk.gmm(a, b, g))
    with pk.use_target("sm_90"):
        jaxpr = str(jax.make_jaxpr(jax.grad(loss, (0, 1)))(*args))
    assert jaxpr.count("name=tutel_gmm\n") == 2 and jaxpr.count("name=tutel_tgmm\n") == 1, jaxpr


# ---------------------------------------------------------------------------------- compiled programs (jax 0.12)

_CHILD = textwrap.dedent('''
    import json, re, sys
    import jax, jax.numpy as jnp
    from jax.experimental import topologies
    from tutel_jax.compile._topology import parse_target, topology_of
    import pallas_kernels as pk

    hardware = sys.argv[1]
    mesh = topologies.make_mesh(topology_of(parse_target(hardware)), (1,), ("x",))
    SDS = jax.ShapeDtypeStruct
    T, K, N, G = 300, 512, 384, 8  # 300 rows: padded to a multiple of 8 (gmm) and 64 (tgmm) around the kernel
    bf16 = jnp.bfloat16
    M = "mosaic_gpu"
    cases = {
        "forward": (lambda a, b, g: pk.gmm(a, b, g, implementation=M), [SDS((T, K), bf16), SDS((G, K, N), bf16)]),
        "forward_transposed": (lambda a, b, g: pk.gmm(a, b, g, transpose_rhs=True, implementation=M),
                               [SDS((T, K), bf16), SDS((G, N, K), bf16)]),
        "backward": (jax.value_and_grad(lambda a, b, g: jnp.sum(pk.gmm(a, b, g, implementation=M)
                                                              .astype(jnp.float32)), (0, 1)),
                     [SDS((T, K), bf16), SDS((G, K, N), bf16)]),
        "default": (lambda a, b, g: pk.gmm(a, b, g, implementation="auto"), [SDS((T, K), bf16), SDS((G, K, N), bf16)]),
    }
    call = re.compile(r'custom_call_target="([^"]+)"')
    result = {}
    for name, (fn, args) in cases.items():
        with jax.set_mesh(mesh):
            text = jax.jit(fn).lower(*args, SDS((G,), jnp.int32)).compile(
                compiler_options={"xla_gpu_autotune_level": 0}).as_text()
        targets = call.findall(text)
        result[name] = {"mosaic": targets.count("mosaic_gpu_v2"), "triton": sum("triton" in t for t in targets),
                        "scoped": text.count("tutel_gmm_mosaic_gpu") > 0}
    print("RESULT " + json.dumps(result))
''')


def _deviceless_unavailable() -> str | None:
    from tutel_jax.compile._topology import DevicelessUnavailable, check_deviceless, parse_target
    try:
        check_deviceless(parse_target("h100"))
    except DevicelessUnavailable as error:
        return str(error)
    return mosaic_gpu_gmm.unavailable_reason()


def _compile_in_child(hardware: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", _CHILD, hardware], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("hardware", ["h100", "b200"])
def test_mosaic_gpu_gmm_compiles_for_hopper_and_blackwell(hardware):
    """Compiled for one H100 / one B200: gmm with implementation="mosaic_gpu" (plain and transposed rhs) is
    tokamax's Mosaic GPU kernel; its backward takes d lhs from it and d rhs (tgmm) from Triton; the default
    implementation is the Triton kernel."""
    reason = _deviceless_unavailable()
    if reason is not None:
        pytest.skip(f"needs jax >= 0.12 with the CUDA plugin and tokamax: {reason}")
    result = _compile_in_child(hardware)
    for name in ("forward", "forward_transposed"):
        assert result[name]["mosaic"] == 1 and result[name]["triton"] == 0, (name, result)
        assert result[name]["scoped"], result
    assert result["backward"]["mosaic"] == 2 and result["backward"]["triton"] == 1, result["backward"]
    assert result["default"]["mosaic"] == 0 and result["default"]["triton"] == 1, result["default"]
