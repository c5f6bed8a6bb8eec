"""The Mosaic TPU quantized grouped matmul (`pallas_kernels.quant._pallas_mosaic_tpu`, `quant_gmm(..., implementation="tpu")`).

- Through Pallas' interpreter ("tpu_interpret") on CPU against `quant_gmm_reference` (dequantize to float32, then
  `lax.ragged_dot` at HIGHEST), for FP8 block, MXFP4 and NVFP4: uneven and empty groups, rows past the sum,
  groups past T, N not a multiple of the 128-column tile, K not a multiple of 128 (FP8 block takes any K; MXFP4
  needs K % 32 == 0 and NVFP4 K % 16 == 0, their formats' block sizes), several row tiles and N tiles.
- Deviceless compiles for a TPU v5p slice (JAX >= 0.12 with libtpu; skipped with that reason elsewhere): the op
  inside `shard_map` with the default implementation is the Mosaic kernel (a `tpu_custom_call` whose op name holds
  the kernel's name), outside `shard_map` "auto" falls back to XLA, and an expert-parallel SwiGLU MoE layer with
  FP8-block experts holds the kernel.

Tolerances, as max |actual - expected| <= tol * max(1, max |expected|) (`assert_close`): float32 outputs 1e-5
(with bfloat16 activations too: e4m3 / E2M1 x scale values are exact in bfloat16, so the products are exact and
only the float32 summation order differs); bfloat16 outputs 8e-3 (one rounding to bfloat16, 2**-8 relative).
"""

from __future__ import annotations

import importlib.util
import os
import re

# several test processes may load libtpu at once (deviceless compiles touch no device)
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_kernels as pk
from pallas_kernels.quant import _pallas_mosaic_tpu as tpu_quant_gmm

from support.kernels import assert_close, random_normal

TPU = "tpu_interpret"
F32_TOL = 1e-5
BF16_OUT_TOL = 8e-3
QUANTIZE = {name: fmt.quantize for name, fmt in pk.quant.FORMATS.items()}


def _weight(fmt: str, seed: int, shape) -> object:
    return QUANTIZE[fmt](random_normal(seed, shape))


def _reference(x, w, sizes):
    return pk.quant_gmm_reference(x, w, sizes, out_dtype=jnp.float32)


# ---------------------------------------------------------------------------------------------- interpreter


CASES = [
    # format, activation dtype, T, K, N, group sizes, tiling (None: the default rule)
    ("fp8_block", jnp.float32, 50, 200, 136, [10, 0, 17, 20], (16, 128)),  # empty group, 3 rows past the sum,
    #                                                                          K and N tails
    ("fp8_block", jnp.bfloat16, 40, 256, 40, [0, 25, 30], None),          # a group past T (cut), N < 128
    ("mxfp4", jnp.float32, 45, 96, 130, [7, 0, 20, 12], (16, 128)),       # 6 rows past the sum, N tail
    ("mxfp4", jnp.bfloat16, 24, 544, 64, [24, 0], None),                  # K past one 512-column chunk
    ("nvfp4", jnp.float32, 33, 48, 16, [0, 0, 33], None),                 # only the last group has rows
    ("nvfp4", jnp.bfloat16, 37, 80, 136, [5, 9, 0, 13], (16, 128)),       # 10 rows past the sum, N tail
    ("int8", jnp.float32, 50, 200, 136, [10, 0, 17, 20], (16, 128)),       # K and N tails, rows past the sum
    ("int8", jnp.bfloat16, 24, 544, 64, [24, 0], None),                   # K past one 512-column chunk
    ("fp8_channel", jnp.float32, 45, 96, 130, [7, 0, 20, 12], (16, 128)),  # N tail, rows past the sum
    ("fp8_channel", jnp.bfloat16, 40, 640, 40, [0, 25, 30], None),        # a group past T, K past a chunk
]


@pytest.mark.parametrize("fmt, dtype, rows, k, n, sizes, tiling", CASES)
def test_matches_reference(fmt, dtype, rows, k, n, sizes, tiling):
    """float32 outputs from float32 or bfloat16 activations, within 1e-5 of the float32 reference."""
    x = random_normal(rows, (rows, k), dtype)
    w = _weight(fmt, k + n, (len(sizes), n, k))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    out = jax.jit(lambda x, w, s: tpu_quant_gmm.quant_gmm_tpu(x, w, s, out_dtype=jnp.float32, interpret=True,
                                                              tiling=tiling))(x, w, group_sizes)
    assert out.shape == (rows, n) and out.dtype == jnp.float32
    expected = _reference(x, w, group_sizes)
    assert_close(out, expected, tol=F32_TOL)
    total = min(sum(sizes), rows)
    assert not np.any(np.asarray(out[total:]))  # rows past the groups are exact zeros


def test_op_dispatches_to_the_kernel_with_bf16_output():
    """`quant_gmm(..., implementation="tpu_interpret")` runs this kernel for every format (its pallas_call is in
    the program) and rounds once to the bfloat16 output."""
    rows, k, n, sizes = 40, 64, 144, jnp.asarray([12, 0, 21], jnp.int32)
    x = random_normal(1, (rows, k), jnp.bfloat16)
    op = jax.jit(lambda x, w, s: pk.quant_gmm(x, w, s, implementation=TPU))
    for fmt in sorted(QUANTIZE):
        w = _weight(fmt, 2, (3, n, k))
        assert f"{tpu_quant_gmm.KERNEL_NAME}_{fmt}" in str(jax.make_jaxpr(op)(x, w, sizes)), fmt
    out = op(x, w, sizes)  # the last format (NVFP4) runs
    assert out.dtype == jnp.bfloat16 and out.shape == (rows, n)
    assert_close(out, _reference(x, w, sizes), tol=BF16_OUT_TOL)
    assert not np.any(np.asarray(out[33:], np.float32))


def test_nvfp4_global_scale_that_multiplies():
    """ModelOpt's convention (`global_multiplies`): the per-expert global scale multiplies the accumulator."""
    w = _weight("nvfp4", 3, (2, 24, 32))
    w = pk.Nvfp4Weight(w.packed, w.scale, 1.0 / w.global_scale, global_multiplies=True)
    x = random_normal(4, (20, 32))
    sizes = jnp.asarray([9, 11], jnp.int32)
    out = jax.jit(lambda x, w: tpu_quant_gmm.quant_gmm_tpu(x, w, sizes, interpret=True))(x, w)
    assert_close(out, _reference(x, w, sizes), tol=F32_TOL)


def test_empty_inputs_give_zeros():
    w = _weight("fp8_block", 0, (2, 16, 32))
    out = pk.quant_gmm(jnp.zeros((0, 32)), w, jnp.asarray([0, 0], jnp.int32), implementation=TPU)
    assert out.shape == (0, 16)
    out = pk.quant_gmm(random_normal(1, (5, 32)), w, jnp.asarray([0, 0], jnp.int32), implementation=TPU)
    assert out.shape == (5, 16) and not np.any(np.asarray(out))


def test_unsupported_calls_raise_not_supported():
    """Explicit "tpu_interpret" re-raises the kernel's NotSupported; "xla" still runs the reference."""
    w = _weight("mxfp4", 0, (2, 16, 32))
    sizes = jnp.asarray([3, 4], jnp.int32)
    x16 = random_normal(1, (7, 32), jnp.float16)
    with pytest.raises(pk.NotSupported, match="float32 or bfloat16"):
        pk.quant_gmm(x16, w, sizes, implementation=TPU)
    with pytest.raises(pk.NotSupported, match="VMEM"):  # K so large that no tile fits the VMEM budget
        tpu_quant_gmm.check_supported(jax.eval_shape(lambda: pk.quantize_fp8_block(jnp.zeros((1, 128, 1 << 21)))),
                                      jnp.float32, jnp.float32, 128)


def test_traces_under_grad_of_other_arguments():
    """Forward only, as the op's other kernels: differentiating a program with respect to something else than
    the op's inputs works (the kernel is evaluated, not differentiated)."""
    w = _weight("fp8_block", 5, (2, 24, 40))
    x = random_normal(6, (16, 40))
    sizes = jnp.asarray([6, 10], jnp.int32)

    def loss(a):
        return jnp.sum(pk.quant_gmm(x, w, sizes, implementation=TPU) * a)

    out = pk.quant_gmm(x, w, sizes, implementation=TPU)
    np.testing.assert_allclose(float(jax.jit(jax.grad(loss))(2.0)), float(jnp.sum(out)), rtol=1e-6)


def test_work_items_cover_every_row_once():
    """The schedule: every row below T is written by exactly one item (its group's, or the pseudo group's past
    the sum), unused items repeat the last tile and write nothing, `first` marks each tile's first visit."""
    sizes = jnp.asarray([0, 5, 40, 0, 3, 9], jnp.int32)
    rows, tm = 70, 16
    group, weight_group, tile, start, end, first = (np.asarray(a) for a in
                                                    tpu_quant_gmm.work_items(sizes, rows, tm))
    writes = np.zeros(rows, np.int32)
    for g, t, s, e in zip(group, tile, start, end):
        r = np.arange(t * tm, min((t + 1) * tm, rows))
        mine = r[(r >= s) & (r < e)]
        writes[mine] += 1
        if g > len(sizes):
            assert mine.size == 0 and t == (rows - 1) // tm
    np.testing.assert_array_equal(writes, 1)
    np.testing.assert_array_equal(first, np.r_[1, tile[1:] != tile[:-1]].astype(np.int32))
    assert np.all(np.diff(tile) >= 0) and np.all(weight_group < len(sizes)) and np.all(weight_group >= 0)


# ------------------------------------------------------------------------------------- deviceless TPU compiles


MOSAIC = re.compile(r'custom_call_target="tpu_custom_call".*?op_name="([^"]+)"')


def _kernels(hlo: str) -> list[str]:
    """Op names of the Mosaic custom calls of this kernel in compiled HLO text."""
    return [op for op in MOSAIC.findall(hlo) if tpu_quant_gmm.KERNEL_NAME in op]


@pytest.fixture(scope="module")
def v5p_mesh():
    if tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 12):
        pytest.skip(f"deviceless TPU compiles need JAX >= 0.12 (have {jax.__version__})")
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("deviceless TPU compiles need libtpu (pip install 'jax[tpu]')")
    from jax.experimental import topologies

    topo = topologies.get_topology_desc("v5p:2x2x2", platform="tpu")
    return topologies.make_mesh(topo, (len(topo.devices),), ("x",))


def _sharded(mesh, tree, spec=P()):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec)), tree)


@pytest.mark.parametrize("fmt, dtype", [("fp8_block", jnp.bfloat16), ("fp8_block", jnp.float32),
                                        ("mxfp4", jnp.bfloat16), ("nvfp4", jnp.bfloat16), ("int8", jnp.bfloat16),
                                        ("fp8_channel", jnp.bfloat16)])
def test_default_op_in_shard_map_compiles_to_mosaic(v5p_mesh, fmt, dtype):
    mesh = v5p_mesh
    n = mesh.devices.size
    experts, rows, k, dim = 4, 96, 640, 384  # K: 5 FP8 blocks, 1.25 FP4 chunks
    w = jax.eval_shape(lambda: QUANTIZE[fmt](jnp.zeros((experts, dim, k))))

    def body(x, w, sizes):
        return pk.quant_gmm(x, w, sizes[0])

    fn = jax.shard_map(body, in_specs=(P("x"), P(), P("x")), out_specs=P("x"))
    args = (jax.ShapeDtypeStruct((n * rows, k), dtype, sharding=NamedSharding(mesh, P("x"))), _sharded(mesh, w),
            jax.ShapeDtypeStruct((n, experts), jnp.int32, sharding=NamedSharding(mesh, P("x"))))
    with jax.set_mesh(mesh):
        hlo = jax.jit(fn).lower(*args).compile().as_text()
    names = _kernels(hlo)
    assert len(names) == 1 and f"{tpu_quant_gmm.KERNEL_NAME}_{fmt}" in names[0], names


def test_outside_shard_map_auto_falls_back_to_xla(v5p_mesh):
    """XLA cannot partition a Mosaic kernel over the mesh: outside shard_map "auto" compiles the reference."""
    mesh = v5p_mesh
    w = _sharded(mesh, jax.eval_shape(lambda: pk.quantize_fp8_block(jnp.zeros((4, 256, 256)))))
    args = (jax.ShapeDtypeStruct((128, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P())), w,
            jax.ShapeDtypeStruct((4,), jnp.int32, sharding=NamedSharding(mesh, P())))
    with jax.set_mesh(mesh):
        hlo = jax.jit(lambda x, w, s: pk.quant_gmm(x, w, s)).lower(*args).compile().as_text()
    assert _kernels(hlo) == []


def test_moe_layer_with_fp8_experts_holds_the_kernel(v5p_mesh):
    """An expert-parallel dropless SwiGLU layer with FP8-block experts (`make_config`, `moe_apply_parallel`),
    default settings: gate, up and down projections run on the kernel (3 calls per path: the grouped rows of the
    ragged exchange and its padded fallback, the capacity buffers at each bucket of the default padded
    exchange)."""
    from tutel_jax import init_params, make_config
    from tutel_jax.parallel import ExpertParallel, moe_apply_parallel

    mesh = jax.sharding.Mesh(v5p_mesh.devices, ("expert",))
    world = mesh.devices.size
    experts = {"type": "swiglu", "count_per_node": 2, "hidden_size_per_expert": 384, "weight_format": "fp8_block"}
    config = make_config({"type": "mixtral", "k": 2}, 256, experts, world_size=world, dtype=jnp.bfloat16)
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    spec = lambda path: P("expert") if "experts" in jax.tree_util.keystr(path) else P()
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec(path))), params)
    x = jax.ShapeDtypeStruct((world * 48, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("expert")))
    placement = ExpertParallel(mesh, expert_axes=("expert",))

    for exchange in ("ragged", None):
        def forward(p, x):
            kwargs = {} if exchange is None else {"dropless_exchange": exchange}
            return moe_apply_parallel(p, x, config, placement, **kwargs)[0]

        with jax.set_mesh(mesh):
            hlo = jax.jit(forward).lower(params, x).compile().as_text()
        names = _kernels(hlo)
        assert names and all(f"{tpu_quant_gmm.KERNEL_NAME}_fp8_block" in op for op in names), names
        assert len(names) % 3 == 0, names
