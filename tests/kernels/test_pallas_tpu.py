"""Mosaic TPU kernels through Pallas' interpreter ("tpu_interpret") on CPU, against independent references.

- gmm / tgmm (gmm/pallas_mosaic_tpu.py, JAX's megablox kernels): `lax.ragged_dot` / `lax.ragged_dot_general`, and gradients
  through jax.grad against the gradients of `lax.ragged_dot` itself.
- encode / decode / permute / unpermute (dispatch/pallas_mosaic_tpu.py): the plain index gathers of dispatch/reference.py.
- implementation choice: "auto" for a program compiled for a TPU picks "tpu" for these ops, "xla" for ops
  without a TPU kernel, for unsupported dtypes and for calls XLA would have to partition.

Tolerances, as max |actual - expected| <= tol * max(1, max |expected|): float32 1e-5 (the kernels differ from
the references only in summation order); bfloat16 2e-2 (outputs rounded once to bf16 vs per step).
Shapes stay small: the interpreter runs every grid step on the CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from pallas_kernels.dispatch import _pallas_mosaic_tpu as tpu_dispatch
from pallas_kernels.gmm import _pallas_mosaic_tpu as tpu_gmm
from tutel_jax.routing import _dispatch as tutel_dispatch

from support.kernels import assert_close, random_normal

TPU = "tpu_interpret"
F32_TOL = 1e-5
BF16_TOL = 2e-2


def _tol(dtype) -> float:
    return F32_TOL if jnp.dtype(dtype) == jnp.float32 else BF16_TOL


def _ragged(lhs, rhs, sizes):
    """Independent reference: lax.ragged_dot in float32 at HIGHEST precision."""
    return jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes,
                              precision=jax.lax.Precision.HIGHEST)


def _ragged_t(lhs, grad, sizes):
    """[G, K, N] per-group lhs.T @ grad, by masking each group's rows (independent of ragged_dot_general)."""
    ends = np.cumsum(np.asarray(sizes))
    starts = ends - np.asarray(sizes)
    rows = np.arange(lhs.shape[0])
    out = []
    for s, e in zip(starts, ends):
        mask = jnp.asarray(((rows >= s) & (rows < e))[:, None], jnp.float32)
        out.append(jnp.matmul((lhs.astype(jnp.float32) * mask).T, grad.astype(jnp.float32),
                              precision=jax.lax.Precision.HIGHEST))
    return jnp.stack(out)


# -------------------------------------------------------------------------------------------- grouped matmul


GMM_CASES = [
    # rows, K, N, group sizes, dtype, tiling (None: the default rule)
    (50, 40, 24, [10, 0, 17, 20], jnp.float32, None),             # empty group, 3 rows past the sum
    (37, 136, 200, [5, 9, 13, 10], jnp.bfloat16, None),           # bf16, K/N not multiples of 128
    (70, 200, 136, [0, 33, 0, 30], jnp.float32, (16, 128, 128)),  # partial K and N tiles, groups across tiles
    (20, 16, 16, [30, 5], jnp.float32, None),                     # groups past T are cut at T
]


@pytest.mark.parametrize("rows, k, n, sizes, dtype, tiling", GMM_CASES)
def test_gmm_forward(rows, k, n, sizes, dtype, tiling):
    lhs = random_normal(rows, (rows, k), dtype)
    rhs = random_normal(k, (len(sizes), k, n), dtype)
    sizes = jnp.asarray(sizes, jnp.int32)
    if tiling is None:  # the op: "tpu_interpret" through the op, default tiling
        out = jax.jit(lambda a, b, s: pk.gmm(a, b, s, implementation=TPU))(lhs, rhs, sizes)
    else:
        out = jax.jit(lambda a, b, s: tpu_gmm.gmm_tpu(a, b, s, interpret=True, tiling=tiling))(lhs, rhs, sizes)
    assert out.dtype == dtype and out.shape == (rows, n)
    assert_close(out, _ragged(lhs, rhs, sizes), tol=_tol(dtype))
    total = min(int(np.sum(sizes)), rows)
    assert not np.any(np.asarray(out[total:], np.float32))  # zeros past the groups (megablox leaves them unset)


def test_gmm_transposed_rhs_and_f32_output():
    lhs = random_normal(0, (30, 24), jnp.bfloat16)
    rhs = random_normal(1, (3, 20, 24), jnp.bfloat16)  # [G, N, K]
    sizes = jnp.asarray([12, 0, 18], jnp.int32)
    out = jax.jit(lambda a, b: pk.gmm(a, b, sizes, transpose_rhs=True, preferred_element_type=jnp.float32,
                                      implementation=TPU))(lhs, rhs)
    assert out.dtype == jnp.float32
    # bf16 x bf16 products are exact in float32: only the summation order differs
    assert_close(out, _ragged(lhs, jnp.swapaxes(rhs, 1, 2), sizes), tol=F32_TOL)


def test_gmm_zero_rows_and_no_groups():
    rhs = random_normal(0, (2, 8, 16))
    out = pk.gmm(jnp.zeros((0, 8)), rhs, jnp.asarray([0, 0], jnp.int32), implementation=TPU)
    assert out.shape == (0, 16)
    out = pk.tgmm(jnp.zeros((0, 8)), jnp.zeros((0, 16)), jnp.asarray([0, 0], jnp.int32), implementation=TPU)
    assert out.shape == (2, 8, 16) and not np.any(np.asarray(out))
    out = tpu_gmm.gmm_tpu(random_normal(1, (5, 8)), jnp.zeros((0, 8, 16)), jnp.zeros((0,), jnp.int32))
    assert out.shape == (5, 16) and not np.any(np.asarray(out))


@pytest.mark.parametrize("rows, k, n, sizes, dtype, tiling", [
    (45, 24, 40, [10, 0, 30], jnp.float32, None),              # empty group -> zero block; 5 rows ignored
    (70, 200, 136, [0, 33, 0, 30], jnp.float32, (16, 128, 128)),  # several row steps, partial K/N tiles
    (32, 16, 16, [32], jnp.bfloat16, None),
])
def test_tgmm(rows, k, n, sizes, dtype, tiling):
    lhs = random_normal(rows, (rows, k), dtype)
    grad = random_normal(n, (rows, n), dtype)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    if tiling is None:
        out = jax.jit(lambda a, b: pk.tgmm(a, b, group_sizes, implementation=TPU))(lhs, grad)
    else:
        out = jax.jit(lambda a, b: tpu_gmm.tgmm_tpu(a, b, group_sizes, interpret=True, tiling=tiling))(lhs, grad)
    assert out.dtype == dtype and out.shape == (len(sizes), k, n)
    assert_close(out, _ragged_t(lhs, grad, sizes), tol=_tol(dtype))


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_gradients(transpose_rhs):
    """The custom VJP on the TPU kernels (d lhs = gmm with rhs the other way round, d rhs = tgmm) against
    jax.grad of lax.ragged_dot."""
    rows, k, n = 41, 24, 40
    sizes = jnp.asarray([9, 0, 20, 7], jnp.int32)  # 5 rows past the sum get zero gradient
    lhs = random_normal(0, (rows, k))
    rhs = random_normal(1, (4, n, k) if transpose_rhs else (4, k, n))
    cot = random_normal(2, (rows, n))

    def ours(a, b):
        return jnp.sum(pk.gmm(a, b, sizes, transpose_rhs=transpose_rhs, implementation=TPU) * cot)

    def reference(a, b):
        b = jnp.swapaxes(b, 1, 2) if transpose_rhs else b
        return jnp.sum(_ragged(a, b, sizes) * cot)

    got = jax.jit(jax.grad(ours, (0, 1)))(lhs, rhs)
    want = jax.grad(reference, (0, 1))(lhs, rhs)
    for a, b in zip(got, want):
        assert_close(a, b, tol=F32_TOL)
    jaxpr = str(jax.make_jaxpr(jax.grad(ours, (0, 1)))(lhs, rhs))
    assert jaxpr.count("pallas_call") >= 3  # forward, d lhs and d rhs all on the kernel


def test_gmm_inside_shard_map_with_check_vma():
    """Expert-parallel use: the kernel runs per shard inside shard_map with check_vma on."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("x",))
    lhs = random_normal(0, (2 * 24, 16))
    rhs = random_normal(1, (2, 16, 8))
    sizes = jnp.asarray([[10, 9], [4, 20]], jnp.int32)  # per shard

    def body(a, b, s):
        return pk.gmm(a, b, s[0], implementation=TPU)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(), P("x")), out_specs=P("x"), check_vma=True)
    out = jax.jit(fn)(lhs, rhs, sizes)
    want = jnp.concatenate([_ragged(lhs[:24], rhs, sizes[0]), _ragged(lhs[24:], rhs, sizes[1])])
    assert_close(out, want, tol=F32_TOL)
    # the replicated rhs gets the sum of both shards' gradients (the custom VJP's psum)
    cot = random_normal(2, out.shape)
    got = jax.jit(jax.grad(lambda b: jnp.sum(fn(lhs, b, sizes) * cot)))(rhs)
    ref = jax.grad(lambda b: jnp.sum(jnp.concatenate([_ragged(lhs[:24], b, sizes[0]),
                                                      _ragged(lhs[24:], b, sizes[1])]) * cot))(rhs)
    assert_close(got, ref, tol=F32_TOL)


def test_bad_tiling_is_rejected():
    lhs, rhs, sizes = random_normal(0, (16, 200)), random_normal(1, (1, 200, 8)), jnp.asarray([16], jnp.int32)
    with pytest.raises(ValueError, match="tiling tk"):
        tpu_gmm.gmm_tpu(lhs, rhs, sizes, tiling=(16, 100, 8), interpret=True)
    with pytest.raises(ValueError, match="tiling tm"):
        tpu_gmm.gmm_tpu(lhs, rhs, sizes, tiling=(12, 200, 8), interpret=True)


# ---------------------------------------------------------------------------------------- dispatch / combine


def _buffer_slots(seed, tokens, experts, k, capacity):
    routing = pk.gating_reference(random_normal(seed, (tokens, experts), scale=2.0), k)
    slots = jnp.where(routing.locations < capacity, routing.expert_ids * capacity + routing.locations,
                      experts * capacity)
    return slots.astype(jnp.int32), routing


@pytest.mark.parametrize("tokens, experts, dim, k, capacity, dtype, block_rows", [
    (37, 6, 40, 2, 9, jnp.float32, 16),    # drops, empty slots, partial last row block, M not a lane multiple
    (50, 4, 136, 1, 20, jnp.bfloat16, None),  # k = 1, bf16, default row block
    (20, 8, 16, 8, 3, jnp.float32, 8),     # k = 8, many drops
])
def test_encode_decode(tokens, experts, dim, k, capacity, dtype, block_rows):
    x = random_normal(tokens, (tokens, dim), dtype)
    slots, routing = _buffer_slots(dim, tokens, experts, k, capacity)
    weights = routing.weights.astype(dtype)
    num_slots = experts * capacity
    data = random_normal(k, (num_slots, dim), dtype)
    if block_rows is None:  # through the ops, default row block
        enc = lambda a, w, s: pk.encode(a, w, s, num_slots, implementation=TPU)
        dec = lambda d, w, s: pk.decode(d, w, s, implementation=TPU)
    else:
        enc = lambda a, w, s: tpu_dispatch.encode_tpu(a, w, s, num_slots, interpret=True, block_rows=block_rows)
        dec = lambda d, w, s: tpu_dispatch.decode_tpu(d, w, s, interpret=True, block_rows=block_rows)
    out = jax.jit(enc)(x, weights, slots)
    assert out.dtype == dtype
    assert_close(out, tutel_dispatch.encode(x, weights, slots, num_slots), tol=0.0)  # one rounding: exact
    out = jax.jit(dec)(data, weights, slots)
    assert out.dtype == dtype
    assert_close(out, tutel_dispatch.decode(data, weights, slots), tol=_tol(dtype))


def test_dropped_rows_are_exact_zeros_even_next_to_infinities():
    x = random_normal(0, (8, 16)).at[3].set(jnp.inf)
    slots = jnp.asarray([[0, 1, 2, 99, 4, 5, 6, 7]], jnp.int32)  # token 3 dropped: its inf must not leak
    weights = jnp.ones((1, 8))
    out = pk.encode(x, weights, slots, 10, implementation=TPU)
    assert np.all(np.isfinite(np.asarray(out))) and not np.any(np.asarray(out[8:]))
    y = pk.decode(out, weights, slots, implementation=TPU)
    assert_close(y, tutel_dispatch.decode(out, weights, slots), tol=F32_TOL)


def test_permute_unpermute_dropless():
    x = random_normal(6, (29, 24), jnp.bfloat16)
    routing = pk.gating_reference(random_normal(7, (29, 7)), 3)
    rows = pk.grouped_rows(routing.expert_ids, routing.locations, routing.counts)
    ones = jnp.ones_like(routing.weights)
    permuted = jax.jit(lambda a: pk.permute(a, ones, rows, implementation=TPU))(x)
    assert_close(permuted, tutel_dispatch.encode(x, ones, rows, 87), tol=0.0)
    back = jax.jit(lambda y: pk.unpermute(y, routing.weights, rows, implementation=TPU))(permuted)
    assert_close(back, tutel_dispatch.decode(permuted, routing.weights, rows), tol=BF16_TOL)


@pytest.mark.parametrize("op", ["encode", "decode"])
def test_dispatch_gradients(op):
    """Custom VJPs on the TPU kernels (dx / ddata on the other kernel, weight gradients by XLA's row dots)
    against jax.grad of the reference."""
    tokens, experts, dim, k, capacity = 23, 4, 24, 2, 7
    slots, routing = _buffer_slots(3, tokens, experts, k, capacity)
    num_slots = experts * capacity
    if op == "encode":
        arg = random_normal(0, (tokens, dim))
        cot = random_normal(1, (num_slots, dim))
        ours = lambda a, w: jnp.sum(pk.encode(a, w, slots, num_slots, implementation=TPU) * cot)
        ref = lambda a, w: jnp.sum(tutel_dispatch.encode(a, w, slots, num_slots) * cot)
    else:
        arg = random_normal(0, (num_slots, dim))
        cot = random_normal(1, (tokens, dim))
        ours = lambda d, w: jnp.sum(pk.decode(d, w, slots, implementation=TPU) * cot)
        ref = lambda d, w: jnp.sum(tutel_dispatch.decode(d, w, slots) * cot)
    got = jax.jit(jax.grad(ours, (0, 1)))(arg, routing.weights)
    want = jax.grad(ref, (0, 1))(arg, routing.weights)
    for a, b in zip(got, want):
        assert_close(a, b, tol=F32_TOL)
    assert "pallas_call" in str(jax.make_jaxpr(jax.grad(ours, (0, 1)))(arg, routing.weights))


def test_default_block_rows():
    assert tpu_dispatch.default_block_rows(256, 4) == 256
    assert tpu_dispatch.default_block_rows(4096, 4, k=8) == 16  # floor: bf16's 16-row sublane tile
    assert tpu_dispatch.default_block_rows(4096, 4, k=1) == 64
    with pytest.raises(ValueError, match="block_rows"):
        tpu_dispatch.gather_rows_tpu(random_normal(0, (4, 8)), jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4)), 4,
                                     block_rows=12, interpret=True)


# ------------------------------------------------------------------------------------------------- choice


def _tpu_mesh(size: int = 1):
    """An abstract mesh of TPU devices (what `jax.set_mesh` with a TPU topology mesh puts in context)."""
    device = jax.sharding.AbstractDevice(device_kind="TPU v5", num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh((size,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                                     abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


def _kernels_in(fn, *args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("pallas_call")


def test_auto_under_a_tpu_mesh_picks_the_tpu_kernels(monkeypatch):
    monkeypatch.delenv(pk.ENV_VAR, raising=False)
    lhs, rhs, sizes = random_normal(0, (16, 8)), random_normal(1, (2, 8, 8)), jnp.asarray([6, 10], jnp.int32)
    x, slots = random_normal(2, (6, 8)), jnp.asarray([[0, 3, 5, 1, 2, 4]], jnp.int32)
    weights = jnp.ones((1, 6))
    half, half_rhs, half_x = lhs.astype(jnp.float16), rhs.astype(jnp.float16), x.astype(jnp.float16)
    with _tpu_mesh():  # only tracing in here: nothing can run on an abstract mesh
        assert pk.compile_platform() == "tpu"
        assert pk.resolve("auto") == ("tpu", "xla")
        assert pk.choose("auto", tpu=True) == "tpu"
        assert pk.choose("auto") == "xla"  # an op without a TPU kernel
        with pytest.raises(pk.NotSupported, match="no Mosaic TPU kernel"):
            pk.choose("tpu")
        assert _kernels_in(lambda a, b: pk.gmm(a, b, sizes), lhs, rhs) == 1
        assert _kernels_in(lambda a, b: pk.tgmm(a, b, sizes), lhs, lhs) == 1
        assert _kernels_in(lambda a, w: pk.encode(a, w, slots, 6), x, weights) == 1
        assert _kernels_in(lambda d, w: pk.decode(d, w, slots), x, weights) == 1
        assert _kernels_in(lambda l: pk.gating(l, 1).expert_ids, x) == 0  # gating has no TPU kernel
        # float16 is not a TPU kernel dtype: auto falls back, an explicit choice raises
        assert _kernels_in(lambda a, b: pk.gmm(a, b, sizes), half, half_rhs) == 0
        with pytest.raises(pk.NotSupported, match="float32 or bfloat16"):
            jax.make_jaxpr(lambda a, b: pk.gmm(a, b, sizes, implementation="tpu"))(half, half_rhs)
        with pytest.raises(pk.NotSupported, match="float32 or bfloat16"):
            jax.make_jaxpr(lambda a: pk.encode(a, weights, slots, 6, implementation="tpu"))(half_x)


def test_auto_declines_calls_xla_would_have_to_partition(monkeypatch):
    """Mosaic kernels cannot be SPMD-partitioned: outside shard_map on a multi-device TPU mesh "auto" uses XLA."""
    monkeypatch.delenv(pk.ENV_VAR, raising=False)
    lhs, rhs, sizes = random_normal(0, (16, 8)), random_normal(1, (2, 8, 8)), jnp.asarray([6, 10], jnp.int32)
    with _tpu_mesh(8):
        assert _kernels_in(lambda a, b: pk.gmm(a, b, sizes), lhs, rhs) == 0
        with pytest.raises(pk.NotSupported, match="shard_map"):
            jax.make_jaxpr(lambda a, b: pk.gmm(a, b, sizes, implementation="tpu"))(lhs, rhs)
        assert _kernels_in(lambda a, b: pk.gmm(a, b, sizes, implementation=TPU), lhs, rhs) == 1  # CPU: no rule


def test_dispatch_declines_tables_beyond_smem(monkeypatch):
    monkeypatch.delenv(pk.ENV_VAR, raising=False)
    with pytest.raises(pk.NotSupported, match="SMEM"):
        tpu_dispatch.check_supported(tpu_dispatch.MAX_TABLE + 1, jnp.float32)
    tpu_dispatch.check_supported(tpu_dispatch.MAX_TABLE, jnp.bfloat16)
