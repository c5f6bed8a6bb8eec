"""The compile gate: a user's expert-parallel MoE program, with default settings, compiled deviceless for an
8-GPU H100 host and a TPU v5p slice (jax >= 0.12 with the CUDA plugin and libtpu), holds the project's kernels.

Kernels are counted in the compiled HLO: custom calls (Triton on GPUs, Mosaic on TPUs) whose op name comes from
a `pallas_call` (XLA's own ragged_dot on TPUs is a Mosaic custom call too, without one). Elsewhere (jax 0.10,
no plugin) every case skips with the reason.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tutel_jax import init_params, make_config, moe_apply
from tutel_jax.compile._topology import DevicelessUnavailable, check_deviceless, parse_target, topology_of
from tutel_jax.parallel import ExpertParallel, moe_apply_parallel

TARGETS = ("h100x8", "v5p:2x2x2")
_CALL = re.compile(r'custom_call_target="([^"]+)".*?op_name="([^"]+)"')
#: the expert layers of the cases (model_dim 384, expert width 640: shapes no other test uses)
CASES = {
    "capacity_ffn_bf16": ({"type": "top", "k": 2, "capacity_factor": 1.25},
                          {"type": "ffn", "count_per_node": 2, "hidden_size_per_expert": 640}, jnp.bfloat16),
    "dropless_swiglu_bf16": ({"type": "mixtral", "k": 2},
                             {"type": "swiglu", "count_per_node": 2, "hidden_size_per_expert": 640}, jnp.bfloat16),
    "dropless_swiglu_mxfp4": ({"type": "mixtral", "k": 2},
                              {"type": "swiglu", "count_per_node": 2, "hidden_size_per_expert": 640,
                               "weight_format": "mxfp4"}, jnp.bfloat16),
}


def _mesh(spelling: str):
    target = parse_target(spelling)
    try:
        check_deviceless(target)
    except DevicelessUnavailable as e:
        pytest.skip(f"deviceless compile for {spelling} unavailable here: {e}")
    from jax.experimental import topologies
    return topologies.make_mesh(topology_of(target), (target.devices,), ("expert",))


def project_kernels(hlo: str) -> list[str]:
    """The op names of the project's kernels in compiled HLO text: Pallas calls, and the Mosaic GPU grouped
    matmul (`mosaic_gpu_v2`, through tokamax)."""
    return [op for target, op in _CALL.findall(hlo) if "pallas_call" in op or target == "mosaic_gpu_v2"]


def _compile(mesh, case: str, train: bool) -> str:
    gate, experts, dtype = CASES[case]
    world = mesh.devices.size
    config = make_config(gate, 384, experts, world_size=world, dtype=dtype)
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    spec = lambda path: P("expert") if "experts" in jax.tree_util.keystr(path) else P()
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec(path))), params)
    x = jax.ShapeDtypeStruct((world * 48, 384), dtype, sharding=NamedSharding(mesh, P("expert")))
    placement = ExpertParallel(mesh, expert_axes=("expert",))

    def forward(p, x):
        y, aux = moe_apply_parallel(p, x, config, placement)
        return jnp.mean(jnp.square(y.astype(jnp.float32))) + aux.l_aux

    program = jax.value_and_grad(forward) if train else forward
    with jax.set_mesh(mesh):
        return jax.jit(program).lower(params, x).compile().as_text()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case, train", [("capacity_ffn_bf16", True), ("dropless_swiglu_bf16", True),
                                         ("dropless_swiglu_mxfp4", False)])
def test_default_program_holds_the_kernels(target, case, train):
    kernels = project_kernels(_compile(_mesh(target), case, train))
    assert kernels, f"{case} compiled for {target} holds no project kernel"
    names = " ".join(kernels)
    # dispatch and combine on every target (across devices, dropless runs the capacity path at a bucket)
    if target.startswith("h100"):
        assert "tutel_encode" in names and "tutel_decode" in names, names
        assert "tutel_gating" in names or "tutel_locate" in names, names  # fused routing (Triton only)
    else:  # Mosaic: encode and decode are one row-gather kernel
        assert names.count("tutel_tpu_gather_rows") >= 2, names
    if case.endswith("mxfp4"):  # packed experts dequantize inside the grouped kernel, never in XLA
        assert "quant_gmm" in names, names


@pytest.mark.parametrize("target", ("h100", "v5p:1x1x1"))
def test_default_single_device_dropless_program_holds_the_grouped_matmul(target):
    """One device, dropless (sort + grouped matmul): gmm forward and its gradient kernels are inside."""
    mesh = _mesh(target)
    gate, experts, dtype = CASES["dropless_swiglu_bf16"]
    config = make_config(gate, 384, experts, dtype=dtype)
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    x = jax.ShapeDtypeStruct((80, 384), dtype)
    loss = lambda p, x: jnp.mean(jnp.square(moe_apply(p, x, config)[0].astype(jnp.float32)))
    with jax.set_mesh(mesh):
        hlo = jax.jit(jax.grad(loss)).lower(params, x).compile().as_text()
    names = " ".join(project_kernels(hlo))
    assert "gmm" in names, names
