"""The execution resolution: the platform a program is compiled for, and `kernel_backend`'s one precedence
(call > runtime > config > default), for float and packed weights alike."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from tutel_jax.layer import _execution as execution
from tutel_jax import init_params, make_config, moe_apply

GPU_KINDS = {"sm_80": "NVIDIA A100-SXM4-80GB", "sm_90": "NVIDIA H100 80GB HBM3"}


def _abstract_mesh(platform: str, kind: str) -> jax.sharding.AbstractMesh:
    """A one-device abstract mesh on `platform` (what `jax.set_mesh` of a deviceless topology puts in context)."""
    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform=platform)
    return jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=device)


@pytest.fixture(autouse=True)
def _no_environment_choice(monkeypatch):
    monkeypatch.delenv(pk.ENV_VAR, raising=False)


def test_platform_is_the_host_without_a_mesh():
    assert execution.platform() == "cpu"
    assert execution.kernels() is None  # plain XLA on CPUs
    assert pk.resolve("auto") == ("xla",)


@pytest.mark.parametrize("platform, expected, order", [
    ("gpu", "gpu", ("pallas", "xla")), ("cuda", "gpu", ("pallas", "xla")), ("rocm", "gpu", ("pallas", "xla")),
    ("tpu", "tpu", ("tpu", "xla")), ("cpu", "cpu", ("xla",))])
def test_platform_comes_from_the_mesh_in_context(platform, expected, order):
    with jax.sharding.use_abstract_mesh(_abstract_mesh(platform, "some device")):
        assert execution.platform() == expected
        assert pk.resolve("auto") == order
        assert execution.kernels() == (None if expected == "cpu" else "auto")
    assert execution.platform() == "cpu"  # restored


@pytest.mark.parametrize("target, kind", list(GPU_KINDS.items()) + [("gfx942", "AMD Instinct MI300X")])
def test_gpu_target_comes_from_the_mesh_device_kind(target, kind):
    with jax.sharding.use_abstract_mesh(_abstract_mesh("gpu", kind)):
        assert pk.current_target().name == target


def test_precedence_call_runtime_config_default(monkeypatch):
    gpu = _abstract_mesh("gpu", GPU_KINDS["sm_90"])
    with jax.sharding.use_abstract_mesh(gpu):
        assert execution.kernels() == "auto"                         # default: the platform's kernels
        assert execution.kernels(config="xla") is None               # config
        assert execution.kernels(config="auto") == "auto"            # "auto" / None: not set at that level
        monkeypatch.setenv(pk.ENV_VAR, "interpret")
        assert execution.kernels(config="xla") == "interpret"        # runtime (environment) > config
        with execution.use_kernels("xla"):
            assert execution.kernels(config="pallas") is None        # runtime (block) > environment > config
            assert execution.kernels(config="xla", call="pallas") == "pallas"  # call > runtime
        monkeypatch.setenv(pk.ENV_VAR, "auto")
        assert execution.kernels(config="tpu") == "tpu"


@pytest.mark.parametrize("bad", ["triton!", "gpu", 1, True])
def test_bad_kernel_backend_is_refused(bad):
    with pytest.raises(ValueError, match="kernel_backend"):
        execution.check_kernel_backend(bad)
    with pytest.raises(ValueError, match="kernel_backend"):
        make_config({"type": "top", "k": 2}, 16, {"type": "ffn", "count_per_node": 2, "hidden_size_per_expert": 32},
                    kernel_backend=bad)


def _pallas_calls(fn, *args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("pallas_call")


@pytest.mark.parametrize("cf", [1.0, 0.0])
def test_default_layer_holds_the_kernels_when_compiled_for_a_gpu(cf):
    """With default settings, the layer traced for a GPU mesh holds the Triton kernels (gating, dispatch,
    grouped matmul); traced for the CPU host, none; 'xla' in the config keeps it plain."""
    experts = {"type": "ffn", "count_per_node": 4, "hidden_size_per_expert": 32}
    config = make_config({"type": "top", "k": 2, "capacity_factor": cf}, 16, experts)
    plain = make_config({"type": "top", "k": 2, "capacity_factor": cf}, 16, experts, kernel_backend="xla")
    params = init_params(config, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (24, 16))
    loss = lambda c: (lambda p, x: jnp.sum(moe_apply(p, x, c)[0] ** 2))
    grad = lambda c: jax.grad(loss(c))
    assert _pallas_calls(grad(config), params, x) == 0
    with jax.sharding.use_abstract_mesh(_abstract_mesh("gpu", GPU_KINDS["sm_90"])):
        assert _pallas_calls(loss(config), params, x) >= 3 and _pallas_calls(grad(config), params, x) >= 3
        assert _pallas_calls(grad(plain), params, x) == 0


def test_default_packed_experts_hold_the_quantized_kernel_when_compiled_for_a_gpu():
    """Packed (MXFP4) SwiGLU experts, dropless, default settings: quant_gmm's kernel for a GPU mesh."""
    experts = {"type": "swiglu", "count_per_node": 4, "hidden_size_per_expert": 64, "weight_format": "mxfp4"}
    config = make_config({"type": "mixtral", "k": 2}, 64, experts)
    params = init_params(config, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (8, 64))
    fn = lambda p, x: moe_apply(p, x, config)[0]
    with jax.sharding.use_abstract_mesh(_abstract_mesh("gpu", GPU_KINDS["sm_90"])):
        assert _pallas_calls(fn, params, x) >= 1


def test_cpu_default_is_unchanged_numerically():
    """The default on a CPU host is the library's own XLA code: equal, bit for bit, to kernel_backend='xla'."""
    experts = {"type": "ffn", "count_per_node": 4, "hidden_size_per_expert": 32}
    default = make_config({"type": "top", "k": 2}, 16, experts)
    plain = make_config({"type": "top", "k": 2}, 16, experts, kernel_backend="xla")
    params = init_params(default, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (24, 16))
    a = jax.jit(lambda p, x: moe_apply(p, x, default)[0])(params, x)
    b = jax.jit(lambda p, x: moe_apply(p, x, plain)[0])(params, x)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_execution_record_validates_every_knob():
    ok = execution.Execution(kernel_backend="pallas", dropless_impl="loop", dense_impl="native",
                             attention_impl="xla", dropless_exchange="ragged", per_layer_jit=True, a2a_ffn_overlap_degree=2,
                             use_2dh=False, adaptive_r=0)
    assert ok.set_fields()["adaptive_r"] == 0 and ok.set_fields()["use_2dh"] is False
    for field, bad in [("kernel_backend", "cuda"), ("dropless_impl", "fast"), ("dense_impl", "blas"),
                       ("attention_impl", "flash"),
                       ("dropless_exchange", "magic"), ("per_layer_jit", "yes"), ("a2a_ffn_overlap_degree", 0),
                       ("a2a_ffn_overlap_degree", True), ("adaptive_r", -1), ("use_2dh", "on")]:
        with pytest.raises(ValueError, match=field):
            execution.Execution(**{field: bad})


def test_execution_precedence_is_field_by_field():
    call = execution.Execution(dropless_impl="loop", kernel_backend="auto")
    runtime = execution.Execution(kernel_backend="xla", a2a_ffn_overlap_degree=2)
    config = execution.Execution(dropless_impl="ragged", kernel_backend="pallas", use_2dh=True)
    merged = call.over(runtime, config)
    assert merged == execution.Execution(dropless_impl="loop", kernel_backend="xla", a2a_ffn_overlap_degree=2,
                                         use_2dh=True)
    assert execution.Execution().over() == execution.Execution()


def test_every_command_gets_the_same_flags():
    import argparse
    parser = argparse.ArgumentParser()
    execution.add_arguments(parser)
    args = parser.parse_args(["--kernel-backend", "xla", "--per-layer-jit", "off", "--a2a-overlap-degree", "4",
                              "--use-2dh", "on", "--adaptive-r", "0", "--dropless-exchange", "padded"])
    got = execution.from_arguments(args)
    assert got == execution.Execution(kernel_backend="xla", per_layer_jit=False, a2a_ffn_overlap_degree=4,
                                      use_2dh=True, adaptive_r=0, dropless_exchange="padded")
    with pytest.raises(ValueError, match="--dropless-exchange does not apply"):  # the first one set, in order
        execution.from_arguments(args, allowed=("kernel_backend", "per_layer_jit"))
    for flag, bad in [("--use-2dh", "maybe"), ("--adaptive-r", "x"), ("--kernel-backend", "cuda")]:
        with pytest.raises(SystemExit):
            parser.parse_args([flag, bad])
