"""fast_encode / fast_decode: values against the NumPy loops, custom VJPs against plain autodiff of a naive
scatter/gather version, and the transpose identity <encode(x), O> = <x, decode(O)>."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import reference_np as ref
from tutel_jax.routing import _dispatch as dispatch
from tutel_jax import fast_decode, fast_encode, top_k_routing


def _plan(S, E, k, cf, seed=0):
    rng = np.random.default_rng(seed)
    scores = ref.softmax(rng.normal(size=(S, E)) * 2).astype(np.float32)
    return top_k_routing(jnp.asarray(scores), k, cf)


def _naive_encode(x, w, slots, num_slots):
    """Autodiff-able reference: scatter-add into the buffer (dropped slots fall off the end)."""
    out = jnp.zeros((num_slots + 1, x.shape[1]), x.dtype)
    for j in range(w.shape[0]):
        out = out.at[jnp.minimum(slots[j], num_slots)].add(w[j][:, None] * x)
    return out[:num_slots]


def _naive_decode(data, w, slots):
    padded = jnp.concatenate([data, jnp.zeros((1, data.shape[1]), data.dtype)])
    idx = jnp.minimum(slots, data.shape[0])
    return sum(w[j][:, None] * padded[idx[j]] for j in range(w.shape[0]))


@pytest.mark.parametrize("S,E,k,cf", [(32, 4, 1, 1.0), (50, 6, 2, 0.5), (64, 8, 3, 1.0), (30, 3, 3, 0.3)])
@pytest.mark.parametrize("postscore", [True, False])
def test_encode_decode_values(S, E, k, cf, postscore):
    plan = _plan(S, E, k, cf)
    M = 8
    x = np.random.default_rng(1).normal(size=(S, M)).astype(np.float32)
    buf = fast_encode(jnp.asarray(x), plan, postscore)
    ids, loc, gates = (np.asarray(a) for a in (plan.expert_ids, plan.locations, plan.gates))
    C = plan.buffer_capacity
    enc_w = np.ones_like(gates) if postscore else gates
    np.testing.assert_allclose(np.asarray(buf), ref.encode(x, ids, loc, enc_w, E, C), rtol=1e-6, atol=1e-7)
    O = np.random.default_rng(2).normal(size=(E, C, M)).astype(np.float32)
    dec_w = gates if postscore else np.ones_like(gates)
    np.testing.assert_allclose(np.asarray(fast_decode(jnp.asarray(O), plan, postscore)),
                               ref.decode(O, ids, loc, dec_w), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["buffer", "grouped"])
def test_custom_vjps_equal_autodiff_of_naive_version(layout):
    plan = _plan(40, 5, 2, 0.6 if layout == "buffer" else 0.0, seed=3)
    if layout == "buffer":
        slots, num_slots = dispatch.buffer_slots(plan), plan.num_experts * plan.buffer_capacity
    else:
        slots, num_slots = dispatch.grouped_slots(plan), plan.gates.size
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(40, 6)), jnp.float32)
    w = jnp.asarray(rng.uniform(0.1, 1.0, size=plan.gates.shape), jnp.float32)
    data = jnp.asarray(rng.normal(size=(num_slots, 6)), jnp.float32)
    g_enc = jnp.asarray(rng.normal(size=(num_slots, 6)), jnp.float32)
    g_dec = jnp.asarray(rng.normal(size=(40, 6)), jnp.float32)

    enc = lambda x, w: jnp.sum(dispatch.encode(x, w, slots, num_slots) * g_enc)
    enc_ref = lambda x, w: jnp.sum(_naive_encode(x, w, slots, num_slots) * g_enc)
    for a, b in zip(jax.grad(enc, (0, 1))(x, w), jax.grad(enc_ref, (0, 1))(x, w)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)

    dec = lambda d, w: jnp.sum(dispatch.decode(d, w, slots) * g_dec)
    dec_ref = lambda d, w: jnp.sum(_naive_decode(d, w, slots) * g_dec)
    np.testing.assert_allclose(np.asarray(dispatch.decode(data, w, slots)), np.asarray(_naive_decode(data, w, slots)),
                               rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.grad(dec, (0, 1))(data, w), jax.grad(dec_ref, (0, 1))(data, w)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_encode_and_decode_are_transposes():
    plan = _plan(48, 6, 2, 0.7, seed=5)
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.normal(size=(48, 4)), jnp.float32)
    O = jnp.asarray(rng.normal(size=(6, plan.buffer_capacity, 4)), jnp.float32)
    w = plan.gates
    slots = dispatch.buffer_slots(plan)
    lhs = jnp.vdot(dispatch.encode(x, w, slots, O.shape[0] * O.shape[1]), O.reshape(-1, 4))
    rhs = jnp.vdot(x, dispatch.decode(O.reshape(-1, 4), w, slots))
    np.testing.assert_allclose(float(lhs), float(rhs), rtol=1e-5)


def test_permute_unpermute_round_trip():
    plan = _plan(30, 4, 3, 0.0, seed=7)
    x = jnp.asarray(np.random.default_rng(8).normal(size=(30, 5)), jnp.float32)
    rows = dispatch.permute(x, plan)  # postscore: plain copies, sorted by expert
    experts = np.asarray(dispatch.group_row_experts(plan.dispatch_count, rows.shape[0]))
    assert (np.diff(experts) >= 0).all()
    back = dispatch.unpermute(rows, plan, is_postscore=False)  # sum of k copies of each token
    np.testing.assert_allclose(np.asarray(back), 3 * np.asarray(x), rtol=1e-6)


def test_fast_decode_rejects_wrong_buffer():
    plan = _plan(16, 4, 1, 1.0)
    with pytest.raises(ValueError, match=r"\[E=4, C=4, M\]"):
        fast_decode(jnp.zeros((4, 5, 3)), plan)
    with pytest.raises(ValueError, match="dropless"):
        dispatch.buffer_slots(_plan(16, 4, 1, 0.0))
