"""Deviceless compiles for TPUs (v5p, v5e) on a CPU host: programs calling gmm / tgmm / encode / decode / quant_gmm with
the default implementation ("auto") under `jax.set_mesh(<TPU topology mesh>)` compile to Mosaic kernels
(`tpu_custom_call` in the compiled HLO), forward and backward.

Needs libtpu and JAX >= 0.12 (`jax.experimental.topologies` meshes usable with `jax.set_mesh`); elsewhere the
tests are skipped with that reason. Mosaic kernels are not SPMD-partitioned by XLA, so on a multi-chip mesh the
ops run inside `shard_map` (as the expert-parallel layers do); outside it "auto" falls back to XLA, which is
checked as well.
"""

from __future__ import annotations

import importlib.util
import os

# several test processes may load libtpu at once (deviceless compiles touch no device)
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_kernels as pk
from tutel_jax.compile._report import kernel_calls

#: topology name -> device kind libtpu reports (v5e is "v5e:<x>x<y>"; "v5litepod" spellings are rejected)
TOPOLOGIES = {"v5p:2x2x2": "TPU v5", "v5e:2x4": "TPU v5 lite"}
MOSAIC = 'custom_call_target="tpu_custom_call"'


def _pallas_kernels(text: str) -> int:
    """Mosaic custom calls that come from a pallas_call (XLA:TPU also lowers e.g. ragged_dot to its own
    tpu_custom_call, which must not count)."""
    return sum(1 for line in text.splitlines() if MOSAIC in line and "pallas_call" in line)


def _requirements() -> str | None:
    if tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 12):
        return f"deviceless TPU compiles need JAX >= 0.12 (have {jax.__version__})"
    if importlib.util.find_spec("libtpu") is None:
        return "deviceless TPU compiles need libtpu (pip install 'jax[tpu]')"
    return None


@pytest.fixture(scope="module", params=sorted(TOPOLOGIES))
def mesh(request):
    reason = _requirements()
    if reason:
        pytest.skip(reason)
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(request.param, platform="tpu")
    assert topo.devices[0].device_kind == TOPOLOGIES[request.param]
    return topologies.make_mesh(topo, (len(topo.devices),), ("x",))


def _spec(mesh, shape, dtype, spec=P()):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _moe_body(x, weights, slots, w1, w2, sizes, *, num_slots):
    """encode -> gmm -> tgmm-shaped weight gradient (via jax.grad) -> decode, all with the default choice."""
    buf = pk.encode(x, weights, slots, num_slots)
    hidden = pk.gmm(buf, w1, sizes)
    out = pk.gmm(jax.nn.relu(hidden).astype(x.dtype), w2, sizes, transpose_rhs=True)
    wgrad = pk.tgmm(buf, hidden, sizes)
    return pk.decode(out, weights, slots), wgrad


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_default_ops_compile_to_mosaic(mesh, dtype):
    n = mesh.devices.size
    tokens, dim, hidden, k, experts = 64, 256, 384, 2, 4
    num_slots = 160  # per shard: 4 experts x capacity 40

    def body(x, weights, slots, w1, w2, sizes):
        return _moe_body(x, weights, slots, w1, w2, sizes[0], num_slots=num_slots)

    fn = jax.shard_map(body, in_specs=(P("x"), P(None, "x"), P(None, "x"), P(), P(), P("x")),
                       out_specs=(P("x"), P("x")))
    args = (_spec(mesh, (tokens * n, dim), dtype, P("x")), _spec(mesh, (k, tokens * n), dtype, P(None, "x")),
            _spec(mesh, (k, tokens * n), jnp.int32, P(None, "x")), _spec(mesh, (experts, dim, hidden), dtype),
            _spec(mesh, (experts, dim, hidden), dtype), _spec(mesh, (n, experts), jnp.int32, P("x")))
    with jax.set_mesh(mesh):
        assert pk.compile_platform() == "tpu"
        text = jax.jit(fn).lower(*args).compile().as_text()
    # encode, 2 x gmm, tgmm, decode
    assert _pallas_kernels(text) >= 5, _pallas_kernels(text)


def test_gradients_compile_to_mosaic(mesh):
    """jax.grad through encode -> gmm -> decode: the backward kernels (decode, gmm with rhs transposed, tgmm,
    encode) compile too."""
    n = mesh.devices.size
    tokens, dim, hidden, k, experts, num_slots = 32, 128, 256, 2, 4, 96

    def loss(x, weights, slots, w1, sizes):
        buf = pk.encode(x, weights, slots, num_slots)
        out = pk.gmm(buf, w1, sizes[0])
        return jnp.sum(pk.decode(out, weights, slots).astype(jnp.float32) ** 2)

    def body(x, weights, slots, w1, sizes):
        # w1 is replicated: its gradient comes back summed over the shards (the custom VJP's psum)
        return jax.grad(loss, (0, 3))(x, weights, slots, w1, sizes)

    fn = jax.shard_map(body, in_specs=(P("x"), P(None, "x"), P(None, "x"), P(), P("x")),
                       out_specs=(P("x"), P()))
    dtype = jnp.bfloat16
    args = (_spec(mesh, (tokens * n, dim), dtype, P("x")), _spec(mesh, (k, tokens * n), dtype, P(None, "x")),
            _spec(mesh, (k, tokens * n), jnp.int32, P(None, "x")), _spec(mesh, (experts, dim, dim), dtype),
            _spec(mesh, (n, experts), jnp.int32, P("x")))
    with jax.set_mesh(mesh):
        text = jax.jit(fn).lower(*args).compile().as_text()
    # forward: encode, gmm, decode; backward: encode (d out), gmm (d buf), tgmm (d w1), decode (d x)
    assert _pallas_kernels(text) >= 7, _pallas_kernels(text)
    calls = kernel_calls(text)  # as `tutel-jax compile` names them: every Mosaic call is the project's
    assert calls.get("tutel_tpu_gmm") == 2 and calls.get("tutel_tpu_tgmm") == 1, calls
    assert all(name.startswith("tutel_") for name in calls), calls


@pytest.mark.parametrize("fmt", sorted(pk.quant.FORMATS))
def test_packed_weights_compile_to_mosaic(mesh, fmt):
    """The default quantized grouped matmul of every weight format, inside shard_map: one Mosaic kernel of
    that format on each topology (v5e's and v5p's Mosaic)."""
    n = mesh.devices.size
    experts, rows, k, dim = 4, 64, 640, 384
    w = jax.eval_shape(lambda: pk.quant.FORMATS[fmt].quantize(jnp.zeros((experts, dim, k))))
    fn = jax.shard_map(lambda x, w, s: pk.quant_gmm(x, w, s[0]), in_specs=(P("x"), P(), P("x")),
                       out_specs=P("x"))
    args = (_spec(mesh, (n * rows, k), jnp.bfloat16, P("x")), jax.tree.map(lambda a: _spec(mesh, a.shape, a.dtype), w),
            _spec(mesh, (n, experts), jnp.int32, P("x")))
    with jax.set_mesh(mesh):
        text = jax.jit(fn).lower(*args).compile().as_text()
    assert kernel_calls(text) == {f"tutel_tpu_quant_gmm_{fmt}": 1}, kernel_calls(text)


def test_outside_shard_map_auto_falls_back_to_xla(mesh):
    """On a multi-chip mesh without shard_map XLA would have to partition the kernel, which it cannot: "auto"
    compiles the XLA reference instead of failing."""
    dtype = jnp.bfloat16
    args = (_spec(mesh, (256, 128), dtype), _spec(mesh, (4, 128, 128), dtype), _spec(mesh, (4,), jnp.int32))
    with jax.set_mesh(mesh):
        text = jax.jit(lambda a, b, s: pk.gmm(a, b, s)).lower(*args).compile().as_text()
    assert _pallas_kernels(text) == 0
