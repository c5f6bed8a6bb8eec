"""Modern routers against the float64 NumPy reference (exact top-k ids, group-limited selection, ties), the plan
they make (Tutel's slots and capacity from any router's choices), expert-choice routing, and the new losses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import reference_routers_np as ref
from tutel_jax.core import _losses as losses
from tutel_jax.routing import make_gate, plan_from_choices, top_k_routing
from tutel_jax.routing._routers import expert_choice_plan, sigmoid_group_topk

S, E = 48, 16


def _logits(seed, S=S, E=E, scale=2.0):
    return (np.random.default_rng(seed).normal(size=(S, E)) * scale).astype(np.float32)


def _select(spec, logits, k, params=None):
    gate = make_gate(spec)
    return gate.select(params or {}, jnp.asarray(logits), k)


def _check(choices, ids_ref, w_ref):
    np.testing.assert_array_equal(np.asarray(choices.expert_ids), ids_ref.T)
    np.testing.assert_allclose(np.asarray(choices.weights), w_ref.T, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind,k,norm", [("mixtral", 2, True), ("qwen3_moe", 2, False), ("qwen3_moe", 4, True),
                                         ("switch", 1, False)])
def test_softmax_routers_match_reference(kind, k, norm):
    logits = _logits(k)
    spec = {"type": kind, "k": k}
    if kind == "qwen3_moe":
        spec["norm_topk_prob"] = norm
    choices = _select(spec, logits, k)
    _check(choices, *ref.softmax_topk(logits.astype(np.float64), k, norm))
    np.testing.assert_allclose(np.asarray(choices.probs), ref.softmax(logits.astype(np.float64)), rtol=1e-6)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_gpt_oss_router_matches_reference(k):
    logits = _logits(10 + k)
    _check(_select({"type": "gpt_oss", "k": k}, logits, k), *ref.topk_softmax(logits.astype(np.float64), k))


@pytest.mark.parametrize("n_group,topk_group,k,norm,scale", [
    (1, 1, 2, True, 1.0), (4, 2, 3, True, 2.5), (8, 3, 4, False, 1.0), (2, 1, 2, True, 2.5), (16, 4, 4, True, 1.0),
])
def test_deepseek_router_matches_reference(n_group, topk_group, k, norm, scale):
    logits = _logits(20 + n_group)
    bias = (np.random.default_rng(n_group).normal(size=E) * 0.3).astype(np.float32)
    got = sigmoid_group_topk(jnp.asarray(logits), k, jnp.asarray(bias), n_group=n_group, topk_group=topk_group,
                             normalize=norm, routed_scaling_factor=scale)
    want = ref.sigmoid_group_topk(logits.astype(np.float64), k, bias.astype(np.float64), n_group, topk_group,
                                  norm, scale)
    _check(got, *want)
    # group-limited: every choice lies in one of the topk_group kept groups
    groups = np.asarray(got.expert_ids) // (E // n_group)
    assert all(len(set(groups[:, s])) <= topk_group for s in range(S))
    # the gate's own select (bias read from its params) gives the same
    gate = make_gate({"type": "deepseek_v3", "k": k, "n_group": n_group, "topk_group": topk_group,
                      "norm_topk_prob": norm, "routed_scaling_factor": scale})
    via_gate = gate.select({"e_score_correction_bias": jnp.asarray(bias)}, jnp.asarray(logits), k)
    np.testing.assert_array_equal(np.asarray(via_gate.expert_ids), np.asarray(got.expert_ids))


def test_deepseek_masked_experts_score_zero_like_hf():
    """HF fills experts outside the kept groups with 0.0, not -inf: a masked expert can then beat a kept one whose
    biased score is negative. Both mask values match the reference."""
    logits = _logits(3, E=8)
    bias = np.where(np.arange(8) % 2 == 0, -0.8, 0.3).astype(np.float32)  # many biased scores below zero
    for mask_value in (0.0, -np.inf):
        got = sigmoid_group_topk(jnp.asarray(logits), 3, jnp.asarray(bias), n_group=2, topk_group=1,
                                 group_mask_value=mask_value)
        want = ref.sigmoid_group_topk(logits.astype(np.float64), 3, bias.astype(np.float64), 2, 1,
                                      mask_value=mask_value)
        _check(got, *want)
    # a token whose kept group has negative biased scores
    neg_logits = np.full((1, 8), -4.0, np.float32)
    neg_logits[0, :2] = 4.0
    neg_bias = np.array([0, 0, -1, -1, -1, -1, -1, -1], np.float32)
    hf = sigmoid_group_topk(jnp.asarray(neg_logits), 3, jnp.asarray(neg_bias), n_group=2, topk_group=1)
    inf = sigmoid_group_topk(jnp.asarray(neg_logits), 3, jnp.asarray(neg_bias), n_group=2, topk_group=1,
                             group_mask_value=-np.inf)
    assert np.asarray(hf.expert_ids)[:, 0].tolist() == [0, 1, 4]  # masked expert 4 (score 0) beats kept 2, 3
    assert np.asarray(inf.expert_ids)[:, 0].tolist() == [0, 1, 2]


def test_ties_go_to_the_lower_index():
    # exact ties in every router: a few distinct values, repeated across experts
    logits = np.tile(np.array([1.0, 3.0, 3.0, 0.5, 3.0, 1.0, 0.5, 1.0], np.float32), (6, 1))
    logits[3] = 0.0  # a token whose scores are all equal
    for spec, fn in [({"type": "mixtral", "k": 3}, lambda l: ref.softmax_topk(l, 3, True)),
                     ({"type": "qwen3_moe", "k": 2}, lambda l: ref.softmax_topk(l, 2, False)),
                     ({"type": "switch"}, lambda l: ref.softmax_topk(l, 1, False)),
                     ({"type": "gpt_oss", "k": 3}, lambda l: ref.topk_softmax(l, 3))]:
        gate = make_gate(spec)
        _check(gate.select({}, jnp.asarray(logits), gate.k), *fn(logits.astype(np.float64)))
    ids = np.asarray(make_gate({"type": "mixtral", "k": 3}).select({}, jnp.asarray(logits), 3).expert_ids)
    assert ids[:, 0].tolist() == [1, 2, 4] and ids[:, 3].tolist() == [0, 1, 2]
    # group ties: two groups with equal scores -> the lower group is kept; equal experts -> lower index
    tied = np.zeros((2, 8), np.float32)
    got = sigmoid_group_topk(jnp.asarray(tied), 2, None, n_group=4, topk_group=2)
    want = ref.sigmoid_group_topk(tied.astype(np.float64), 2, None, 4, 2)
    _check(got, *want)
    assert np.asarray(got.expert_ids)[:, 0].tolist() == [0, 1]


@pytest.mark.parametrize("cf", [1.0, 0.5, 0.0, -0.5])
def test_plan_from_choices_gives_tutel_slots_and_capacity(cf):
    logits = _logits(7, E=8)
    ids, w = ref.sigmoid_group_topk(logits.astype(np.float64), 2, None, 2, 1)
    plan = plan_from_choices(jnp.asarray(ids.T), jnp.asarray(w.T, jnp.float32), 8, cf)
    loc, counts = ref.slots(ids.T, 8)
    np.testing.assert_array_equal(np.asarray(plan.locations), loc)
    np.testing.assert_array_equal(np.asarray(plan.dispatch_count), counts)
    assert int(plan.capacity) == ref.capacity(counts, S, 8, 2, cf)
    np.testing.assert_allclose(np.asarray(plan.gates), w.T, rtol=1e-6)
    # padding tokens take no slot and get weight 0; real tokens keep their order
    valid = np.arange(S) % 3 != 1
    masked = plan_from_choices(jnp.asarray(ids.T), jnp.asarray(w.T, jnp.float32), 8, cf, valid=jnp.asarray(valid))
    loc_v, counts_v = ref.slots(ids.T[:, valid], 8)
    np.testing.assert_array_equal(np.asarray(masked.locations)[:, valid], loc_v)
    np.testing.assert_array_equal(np.asarray(masked.dispatch_count), counts_v)
    assert (np.asarray(masked.gates)[:, ~valid] == 0).all() and not np.asarray(masked.kept)[:, ~valid].any()


def test_top_k_routing_is_plan_from_choices_of_its_top_k():
    scores = jax.nn.softmax(jnp.asarray(_logits(9, E=8)), axis=1)
    plan = top_k_routing(scores, 2, 1.0, batch_prioritized_routing=True)
    top, ids = jax.lax.top_k(scores, 2)
    again = plan_from_choices(ids.T, (top / top.sum(1, keepdims=True)).T, 8, 1.0, priority=scores.max(1))
    for a, b in zip(jax.tree.leaves(plan), jax.tree.leaves(again)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def test_expert_choice_plan_matches_reference():
    logits = _logits(11, S=40, E=8)
    logits[:, 2] = 0.25  # ties inside one expert's column: lower token first
    probs = jax.nn.softmax(jnp.asarray(logits), axis=1)
    plan = expert_choice_plan(probs, 2.0)
    C = 10  # floor(2.0 * 40 / 8)
    assert plan.buffer_capacity == C and int(plan.capacity) == C and plan.top_k == 8
    picks = ref.expert_choice(np.asarray(probs, np.float64), C)
    loc = np.asarray(plan.locations)
    for e in range(8):
        np.testing.assert_array_equal(np.argsort(np.where(loc[e] < C, loc[e], 10 ** 9))[:C], picks[e])
        assert (loc[e] < C).sum() == C
    gates = np.asarray(plan.gates)
    np.testing.assert_allclose(gates[loc < C], np.asarray(probs).T[loc < C], rtol=1e-6)
    assert (gates[loc >= C] == 0).all()
    np.testing.assert_array_equal(np.asarray(plan.dispatch_count), [C] * 8)
    # padding tokens are never picked, even when fewer real tokens than C remain
    valid = np.arange(40) < 6
    masked = expert_choice_plan(probs, 2.0, valid=jnp.asarray(valid))
    mloc = np.asarray(masked.locations)
    assert (mloc[:, ~valid] >= C).all() and (mloc[:, valid] < C).all()
    np.testing.assert_array_equal(np.asarray(masked.dispatch_count), [6] * 8)
    with pytest.raises(ValueError, match="capacity_factor"):
        expert_choice_plan(probs, 0.0)


def test_router_options_validated():
    with pytest.raises(ValueError, match="n_group"):
        sigmoid_group_topk(jnp.zeros((2, 8)), 2, None, n_group=3)
    with pytest.raises(ValueError, match="topk_group"):
        sigmoid_group_topk(jnp.zeros((2, 8)), 2, None, n_group=2, topk_group=3)
    with pytest.raises(ValueError, match="top_k"):
        _select({"type": "mixtral"}, np.zeros((2, 4), np.float32), 5)
    with pytest.raises(ValueError, match="aux_loss"):
        make_gate({"type": "mixtral", "aux_loss": "bogus"})
    with pytest.raises(ValueError, match="unknown option"):
        make_gate({"type": "deepseek_v3", "ngroup": 2})


# -- losses ---------------------------------------------------------------------------------------------------

def test_balance_losses_match_reference():
    logits = _logits(13, S=24, E=8)
    ids, _ = ref.softmax_topk(logits.astype(np.float64), 2, True)
    probs = ref.softmax(logits.astype(np.float64))
    got_switch = losses.switch_load_loss(jnp.asarray(probs, jnp.float32), jnp.asarray(ids.T))
    np.testing.assert_allclose(float(got_switch), ref.switch_load_loss(probs, ids), rtol=1e-6)
    np.testing.assert_allclose(float(losses.router_z_loss(jnp.asarray(logits))),
                               ref.z_loss(logits.astype(np.float64)), rtol=1e-6)
    got_seq = losses.sequence_aux_loss(jnp.asarray(probs, jnp.float32), jnp.asarray(ids.T), 6)
    np.testing.assert_allclose(float(got_seq), ref.sequence_aux_loss(probs, ids, 6), rtol=1e-6)
    # padding tokens are left out: the same as dropping them (sequence-wise: per sequence's real tokens)
    valid = np.ones(24, bool)
    valid[18:] = False  # the last sequence of 6 is all padding... and one more padded token elsewhere
    valid[3] = False
    keep = np.flatnonzero(valid)
    np.testing.assert_allclose(
        float(losses.switch_load_loss(jnp.asarray(probs, jnp.float32), jnp.asarray(ids.T), jnp.asarray(valid))),
        ref.switch_load_loss(probs[keep], ids[keep]), rtol=1e-6)
    np.testing.assert_allclose(float(losses.router_z_loss(jnp.asarray(logits), jnp.asarray(valid))),
                               ref.z_loss(logits[keep].astype(np.float64)), rtol=1e-6)
    uniform = np.full((12, 4), 0.25, np.float32)
    even_ids = np.stack([np.arange(12) % 4, (np.arange(12) + 1) % 4])
    assert float(losses.switch_load_loss(jnp.asarray(uniform), jnp.asarray(even_ids))) == pytest.approx(2.0)
    assert float(losses.sequence_aux_loss(jnp.asarray(uniform), jnp.asarray(even_ids), 4)) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="seq_len"):
        losses.sequence_aux_loss(jnp.asarray(uniform), jnp.asarray(even_ids), 5)


def test_update_correction_bias():
    bias = jnp.asarray([0.0, 0.5, -0.5, 0.0], jnp.float32)
    counts = jnp.asarray([10, 2, 6, 6], jnp.int32)  # mean 6: expert 0 overloaded, 1 underloaded, 2 and 3 even
    new = losses.update_correction_bias(bias, counts, 1e-2)
    np.testing.assert_allclose(np.asarray(new), [-0.01, 0.51, -0.5, 0.0], rtol=1e-6)
    assert new.dtype == bias.dtype


def test_trainable_mask_excludes_the_correction_bias():
    from tutel_jax.routing._routers import trainable_mask
    params = {"gates": [{"weight": jnp.zeros((4, 2)), "e_score_correction_bias": jnp.zeros(4)}],
              "experts": {"down_proj": jnp.zeros((4, 3, 2))}}
    mask = trainable_mask(params)
    assert mask == {"gates": [{"weight": True, "e_score_correction_bias": False}], "experts": {"down_proj": True}}
