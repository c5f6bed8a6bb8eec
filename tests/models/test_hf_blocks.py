"""MoE blocks of the HF fixtures (tests/fixtures/hf/<case>: the LAST MoE layer's weights) run by tutel-jax:

- against a float64 NumPy block written from the HF formulas, reading the checkpoint tensors directly (always);
- against the same formulas in plain torch float32 (optional: `@pytest.mark.torch`, skipped without torch);
- the fixtures' recorded `router_topk_ids` / `router_topk_weights` are checked for the invariants our routers
  produce (renormalisation, routed_scaling_factor, group-limited selection). Comparing them value by value needs
  that layer's input hidden states, i.e. the whole model: that is the full-model test's job.

Inputs are random hidden states; every token's gap between its k-th and (k+1)-th selection score (and, for
DeepSeek, between kept and dropped groups) is checked to be well above float32 noise, so ids compare exactly.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import reference_routers_np as ref
from tutel_jax import moe_apply, route
from tutel_jax.checkpoint._safetensors_io import load_safetensors
from tutel_jax.models import hf_moe_block, moe_layer_indices
from support.paths import HF

CASES = ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"]
BLOCK_CASES = CASES + ["olmoe"]  # olmoe: norm_topk_prob=False, so not in the renormalisation invariants below
MIN_GAP = 1e-4


def _case(name):
    folder = HF / name
    config = json.loads((folder / "config.json").read_text())
    return config, load_safetensors(folder / "model.safetensors"), np.load(folder / "expected.npz")


def _hidden(config, S=32, seed=0):
    return np.random.default_rng(seed).normal(size=(S, config["hidden_size"])).astype(np.float32)


def _prefix(config):
    layer = moe_layer_indices(config)[-1]
    block = "block_sparse_moe" if config["model_type"] == "mixtral" else "mlp"
    return f"model.layers.{layer}.{block}."


def _numpy_block(config, t, x):
    """HF block in float64 from the on-disk tensors: (ids [S, k], weights [S, k], y [S, H], selection gap)."""
    kind, p, k = config["model_type"], _prefix(config), config["num_experts_per_tok"]
    x = x.astype(np.float64)
    f = lambda name: np.asarray(t[p + name], np.float64)
    if kind == "gpt_oss":
        logits = x @ f("router.weight").T + f("router.bias")
        ids, w = ref.topk_softmax(logits, k)
        sel = logits
        expert = lambda e, h: ref.gpt_oss_expert(h, f("experts.gate_up_proj")[e], f("experts.gate_up_proj_bias")[e],
                                                 f("experts.down_proj")[e], f("experts.down_proj_bias")[e],
                                                 config["swiglu_alpha"], config["swiglu_limit"])
    else:
        logits = x @ f("gate.weight").T
        names = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        expert = lambda e, h: ref.swiglu(h, *(f(f"experts.{e}.{n}.weight") for n in names))
        if kind == "deepseek_v3":
            bias = f("gate.e_score_correction_bias")
            ids, w = ref.sigmoid_group_topk(logits, k, bias, config["n_group"], config["topk_group"],
                                            config["norm_topk_prob"], config["routed_scaling_factor"])
            sel = ref.sigmoid(logits) + bias
            gs = sel.shape[1] // config["n_group"]
            groups = np.sort(sel.reshape(len(x), config["n_group"], gs), axis=-1)[..., -2:].sum(-1)
            g = np.sort(groups, axis=1)
            assert (g[:, -config["topk_group"]] - g[:, -config["topk_group"] - 1]).min() > MIN_GAP
            keep = np.argsort(-groups, axis=1, kind="stable")[:, :config["topk_group"]]
            in_kept = ((np.arange(sel.shape[1]) // gs)[None, :, None] == keep[:, None, :]).any(-1)
            sel = np.where(in_kept, sel, 0.0)
        else:
            ids, w = ref.softmax_topk(logits, k, kind == "mixtral" or config.get("norm_topk_prob", False))
            sel = logits
    s = np.sort(sel, axis=1)
    gap = (s[:, -k] - s[:, -k - 1]).min()
    y = ref.moe_block(x, ids, w, expert)
    if kind == "deepseek_v3":
        y = y + ref.swiglu(x, f("shared_experts.gate_proj.weight"), f("shared_experts.up_proj.weight"),
                           f("shared_experts.down_proj.weight"))
    return ids, w, y, gap


def _ours(config, tensors, x, **kw):
    moe_config, params = hf_moe_block(tensors, config, **kw)
    y, _ = jax.jit(lambda p, x: moe_apply(p, x, moe_config))(params, jnp.asarray(x))
    plan, _ = route(params["gates"][0], jnp.asarray(x), moe_config)
    ids = np.asarray(plan.expert_ids).T
    order = np.argsort(ids, axis=1)
    return np.take_along_axis(ids, order, 1), np.take_along_axis(np.asarray(plan.gates).T, order, 1), np.asarray(y)


def _sorted(ids, w):
    order = np.argsort(ids, axis=1)
    return np.take_along_axis(ids, order, 1), np.take_along_axis(w, order, 1)


@pytest.mark.parametrize("case", BLOCK_CASES)
def test_block_matches_float64_hf_formulas(case):
    config, tensors, _ = _case(case)
    x = _hidden(config)
    ids, w, y_ref, gap = _numpy_block(config, tensors, x)
    assert gap > MIN_GAP, f"test input too close to a routing tie ({gap})"
    ids_ref, w_ref = _sorted(ids, w)
    got_ids, got_w, y = _ours(config, tensors, x)
    np.testing.assert_array_equal(got_ids, ids_ref)
    np.testing.assert_allclose(got_w, w_ref, rtol=0, atol=1e-5)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5 * np.abs(y_ref).max())
    # the capacity path with nothing dropped and the bucketed dropless path give the same block
    _, _, y_bucketed = _ours(config, tensors, x, dropless_impl="bucketed")
    np.testing.assert_allclose(y_bucketed, y_ref, rtol=1e-5, atol=1e-5 * np.abs(y_ref).max())


@pytest.mark.parametrize("case", CASES)
def test_recorded_router_choices_have_our_routers_invariants(case):
    """expected.npz's last-layer routing: ids sorted, distinct, in range; weights renormalised (times
    routed_scaling_factor for DeepSeek) and group-limited where the config says so."""
    config, _, expected = _case(case)
    ids, w = expected["router_topk_ids"], expected["router_topk_weights"]
    k, num_experts = config["num_experts_per_tok"], 8
    assert ids.shape[-1] == k and (np.diff(ids, axis=-1) > 0).all() and ids.min() >= 0 and ids.max() < num_experts
    assert (w > 0).all()
    total = config.get("routed_scaling_factor", 1.0) if case == "deepseek_v3" else 1.0
    np.testing.assert_allclose(w.sum(-1), total, rtol=0, atol=1e-5)  # every case renormalises
    if case == "deepseek_v3":
        group = ids // (num_experts // config["n_group"])
        assert (group.max(-1) - group.min(-1) == 0).all()  # topk_group = 1: one group per token


def test_loader_layout_and_errors():
    config, tensors, _ = _case("deepseek_v3")
    moe_config, params = hf_moe_block(tensors, config)
    assert moe_config.num_global_experts == 8 and moe_config.shared_experts is not None
    # routed and shared experts alike: [E, out, in] as stored per expert
    assert {n: w.shape for n, w in params["experts"].items()} == {"gate_proj": (8, 48, 64), "up_proj": (8, 48, 64),
                                                                  "down_proj": (8, 64, 48)}
    np.testing.assert_array_equal(np.asarray(params["experts"]["up_proj"][5]),
                                  tensors[_prefix(config) + "experts.5.up_proj.weight"])
    assert params["shared_experts"]["gate_proj"].shape == (48, 64)
    # GPT-OSS's fused float tensors are stored [E, in, out]: loaded as [E, out, in]
    gpt_config, gpt_tensors, _ = _case("gpt_oss")
    _, gpt = hf_moe_block(gpt_tensors, gpt_config)
    stored = gpt_tensors[_prefix(gpt_config) + "experts.gate_up_proj"]
    np.testing.assert_array_equal(np.asarray(gpt["experts"]["gate_up_proj"]), np.swapaxes(stored, 1, 2))
    gate = moe_config.gates[0]
    assert (gate.n_group, gate.topk_group, gate.routed_scaling_factor) == (2, 1, 2.5)
    with pytest.raises(ValueError, match="no MoE block"):
        hf_moe_block(tensors, config, layer=0)  # first_k_dense_replace = 1: layer 0 is dense
    with pytest.raises(ValueError, match="model_type"):
        hf_moe_block(tensors, {**config, "model_type": "llama"})
    with pytest.raises(ValueError, match="no tensor"):
        hf_moe_block({k: v for k, v in tensors.items() if "experts.3." not in k}, config)


# -- optional: the HF formulas in plain torch ------------------------------------------------------------------

def _torch_block(torch, config, t, x):
    """The HF transformers 5.24 MoE blocks re-implemented with plain torch ops (float32)."""
    F = torch.nn.functional
    kind, p, k = config["model_type"], _prefix(config), config["num_experts_per_tok"]
    f = lambda name: torch.from_numpy(np.asarray(t[p + name]))
    x = torch.from_numpy(x)
    if kind == "gpt_oss":
        logits = F.linear(x, f("router.weight"), f("router.bias"))
        top_v, sel = torch.topk(logits, k, dim=-1)
        weights = F.softmax(top_v, dim=1, dtype=top_v.dtype)
        gu, gub, dn, dnb = (f("experts." + n) for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj",
                                                           "down_proj_bias"))
        limit, alpha = config["swiglu_limit"], config["swiglu_alpha"]

        def expert(e, h):
            gate_up = h @ gu[e] + gub[e]
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            gate = gate.clamp(min=None, max=limit)
            up = up.clamp(min=-limit, max=limit)
            glu = gate * torch.sigmoid(gate * alpha)
            return ((up + 1) * glu) @ dn[e] + dnb[e]
    else:
        names = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")

        def expert(e, h):
            wg, wu, wd = (f(f"experts.{e}.{n}.weight") for n in names)
            return F.linear(F.silu(F.linear(h, wg)) * F.linear(h, wu), wd)

        if kind == "deepseek_v3":
            logits = F.linear(x.type(torch.float32), f("gate.weight").type(torch.float32))
            scores = logits.sigmoid()
            choice = scores + f("gate.e_score_correction_bias")
            n_group, topk_group = config["n_group"], config["topk_group"]
            num_experts = choice.shape[-1]
            group_scores = choice.view(-1, n_group, num_experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores)
            group_mask.scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, num_experts // n_group).reshape(-1, num_experts)
            choice = choice.masked_fill(~score_mask.bool(), 0.0)
            sel = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, sel)
            if config["norm_topk_prob"]:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            weights = weights * config["routed_scaling_factor"]
        else:
            logits = F.linear(x, f("gate.weight"))
            probs = F.softmax(logits, dim=1, dtype=torch.float)
            weights, sel = torch.topk(probs, k, dim=-1)
            if kind == "mixtral" or config.get("norm_topk_prob"):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    for e in range(logits.shape[-1]):
        token, slot = torch.where(sel == e)
        if token.numel():
            out.index_add_(0, token, expert(e, x[token]) * weights[token, slot, None])
    if kind == "deepseek_v3":
        sp = "shared_experts."
        out = out + F.linear(F.silu(F.linear(x, f(sp + "gate_proj.weight"))) * F.linear(x, f(sp + "up_proj.weight")),
                             f(sp + "down_proj.weight"))
    return sel.numpy(), weights.detach().numpy(), out.detach().numpy()


@pytest.mark.torch
@pytest.mark.parametrize("case", BLOCK_CASES)
def test_block_matches_torch_hf_formulas(case):
    torch = pytest.importorskip("torch", reason="optional oracle: the HF block formulas in plain torch "
                                               "(CI installs torch 2.13.0+cpu)")
    config, tensors, _ = _case(case)
    x = _hidden(config, seed=1)
    *_, gap = _numpy_block(config, tensors, x)
    assert gap > MIN_GAP
    with torch.no_grad():
        ids, w, y_ref = _torch_block(torch, config, tensors, x)
    ids_ref, w_ref = _sorted(ids, w)
    got_ids, got_w, y = _ours(config, tensors, x)
    np.testing.assert_array_equal(got_ids, ids_ref)
    np.testing.assert_allclose(got_w, w_ref, rtol=0, atol=1e-5)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5 * np.abs(y_ref).max())
