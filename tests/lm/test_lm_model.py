"""The byte-level MoE language model core (`tutel_jax.lm`) and `models.random_init`.

References: the HF-made fixtures' tensor names and shapes (random_init); float64 NumPy re-implementations of the
next-token cross entropy and of the Qwen3-MoE block, router and switch loss (`reference_routers_np`, written
from the HF formulas); the `tokenizers` ByteLevel pre-tokenizer (byte tokenizer); an HF transformers forward of
the exported checkpoint when transformers is installed. Tolerances: float32 computations against float64
references to rtol 1e-5 (logits atol 1e-5); exact equality where the same program runs on the same params."""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import reference_routers_np as ref
from tutel_jax.checkpoint import open_checkpoint
from tutel_jax.lm import LMSize, bits_per_byte, _byte_tokenizer as byte_tokenizer, causal_context, export_lm, init_lm, lm_eval, lm_loss
from tutel_jax.lm import moe_config
from tutel_jax.models import from_pretrained, spec_from_config, forward, hf_tensor_shapes, random_hf_tensors
from tutel_jax.models._hf_tables import attention_table, expected_shapes, load_params, mlp_prefix
from support.paths import HF

# a tiny model: std 0.2 so that routing and logits are far from uniform
TINY = LMSize(hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, experts=4, top_k=2, expert_hidden=16,
              max_len=64, initializer_range=0.2)


@pytest.fixture(scope="module")
def model():
    return init_lm(TINY, seed=0)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, 256, (8, 9)).astype(np.int32)  # [B, T + 1], T = 8


def _np_ce(logits: np.ndarray, targets: np.ndarray) -> float:
    """float64 mean next-token cross entropy in nats."""
    z = logits.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-np.take_along_axis(logp, targets[..., None].astype(np.int64), -1).mean())


# ------------------------------------------------------------------------------------------------ random_init


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral"])
def test_random_tensors_have_the_hf_fixtures_names_shapes_and_load(case):
    config = json.loads((HF / case / "config.json").read_text())
    tensors = random_hf_tensors(config, seed=3)
    fixture = open_checkpoint(HF / case)
    try:
        assert sorted(tensors) == sorted(fixture)
        for name, a in tensors.items():
            assert a.shape == fixture[name].shape and a.dtype == np.float32, name
    finally:
        fixture.close()
    params, moe_configs = load_params(tensors, config, spec_from_config(config))
    assert len(params["layers"]) == config["num_hidden_layers"]
    assert any(c is not None for c in moe_configs)


def test_random_tensors_init_shapes_and_determinism():
    config = dict(TINY.hf_config(), mlp_only_layers=[1])  # layer 1 dense
    spec = spec_from_config(config)
    tensors = random_hf_tensors(config, seed=5)
    assert list(tensors) == list(hf_tensor_shapes(config))
    shapes = expected_shapes(spec, config)  # [out, in] per our name
    assert tensors["model.embed_tokens.weight"].shape == shapes["embed"]
    assert tensors["lm_head.weight"].shape == shapes["lm_head"]
    for i in range(2):
        p = f"model.layers.{i}."
        for ours, disk in attention_table(spec).items():
            assert tensors[p + "self_attn." + disk].shape == shapes[f"attn.{ours}"], disk
    for k in ("gate_proj", "up_proj", "down_proj"):
        assert tensors[f"model.layers.1.{mlp_prefix(spec)}{k}.weight"].shape == shapes[f"mlp.{k}"]
    assert "model.layers.1.mlp.gate.weight" not in tensors and "model.layers.0.mlp.gate.weight" in tensors
    # HF's init: norms 1, matrices N(0, initializer_range)
    for name, a in tensors.items():
        if "norm" in name:
            np.testing.assert_array_equal(a, 1.0, err_msg=name)
    big = np.concatenate([a.ravel() for n, a in tensors.items() if "norm" not in n])
    # 31872 draws: the sample mean's sd is 0.0011 and the sample std's 0.0008; both bounds are > 6 sd
    assert big.size == 31872 and abs(big.mean()) < 0.007 and abs(big.std() - 0.2) < 0.005
    again, other = random_hf_tensors(config, seed=5), random_hf_tensors(config, seed=6)
    assert all(np.array_equal(again[n], a) for n, a in tensors.items())
    assert not np.array_equal(other["lm_head.weight"], tensors["lm_head.weight"])
    half = random_hf_tensors(config, seed=5, dtype=np.float16)
    np.testing.assert_array_equal(half["lm_head.weight"], tensors["lm_head.weight"].astype(np.float16))
    params, moe_configs = load_params(tensors, config, spec)
    assert moe_configs[1] is None and set(params["layers"][1]) >= {"mlp"} and set(params["layers"][0]) >= {"moe"}


def test_random_tensors_tied_embeddings_and_errors():
    config = dict(TINY.hf_config(), tie_word_embeddings=True)
    tensors = random_hf_tensors(config)
    assert "lm_head.weight" not in tensors
    params, _ = load_params(tensors, config, spec_from_config(config))
    assert "lm_head" not in params
    with pytest.raises(ValueError, match="quantization_config"):
        random_hf_tensors(json.loads((HF / "gpt_oss_mxfp4" / "config.json").read_text()))
    with pytest.raises(ValueError, match="unsupported model_type"):
        random_hf_tensors({"model_type": "llama"})
    with pytest.raises(ValueError, match="dtype"):
        random_hf_tensors(config, dtype=np.int32)
    with pytest.raises(ValueError, match="initializer_range"):
        random_hf_tensors(dict(config, initializer_range=-1.0))
    with pytest.raises(ValueError, match="hidden_size: missing"):
        random_hf_tensors({k: v for k, v in config.items() if k != "hidden_size"})


# --------------------------------------------------------------------------------------------------- LMSize


def test_size_config_and_parameter_counts():
    config = TINY.hf_config()
    assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"]) == ("qwen3_moe", 4, 2)
    assert config["norm_topk_prob"] is True and config["router_aux_loss_coef"] == 0.01
    assert config["eos_token_id"] is None and config["mlp_only_layers"] == []
    dense = TINY.dense_baseline()
    assert dense.dense and dense.hf_config()["mlp_only_layers"] == [0, 1]
    assert dense.hf_config()["intermediate_size"] == 2 * 16
    # counts against the arrays of the initialised models
    moe_model, dense_model = init_lm(TINY), init_lm(dense)
    size = lambda tree: sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(tree))
    assert TINY.total_params() == size(moe_model.params)
    assert dense.total_params() == dense.active_params() == size(dense_model.params)
    moe_layers = [lp["moe"] for lp in moe_model.params["layers"]]
    per_expert = sum(size(moe["experts"]) for moe in moe_layers) // TINY.experts
    routers = sum(size(moe["gates"]) for moe in moe_layers)
    active = size(moe_model.params) - routers - (TINY.experts - TINY.top_k) * per_expert
    assert TINY.active_params() == active == dense.active_params()
    assert all(c is None for c in dense_model.moe_configs)
    with pytest.raises(ValueError, match="distinct MoE layer configs"):
        moe_config(dense_model)
    assert moe_config(moe_model) == moe_model.moe_configs[0] == moe_model.moe_configs[1]


@pytest.mark.parametrize("changes, match", [
    ({"hidden": 0}, "LMSize.hidden must be an integer >= 1"), ({"layers": 2.0}, "LMSize.layers"),
    ({"heads": 6, "kv_heads": 4}, "multiple of kv_heads"), ({"top_k": 5}, "top_k .* <= experts"),
    ({"head_dim": 7}, "head_dim must be even"), ({"vocab": 128}, "vocab must be >= 256"),
    ({"rope_theta": float("nan")}, "rope_theta"), ({"initializer_range": 0}, "initializer_range"),
    ({"dense": 1}, "dense must be a bool")])
def test_size_validation(changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(TINY, **changes)


# -------------------------------------------------------------------------------------- loss, eval, moe hook


def _reference_moe_hook(model, record):
    """moe_fn computing each MoE layer in float64 NumPy (eager forward only: h must be concrete); it records the
    layer's router probabilities [S, E] and choices [S, k]."""
    k = model.config["num_experts_per_tok"]

    def hook(i, p, h):
        x = np.asarray(h, np.float64).reshape(-1, h.shape[-1])  # [S, M]
        logits = x @ np.asarray(p["gates"][0]["weight"], np.float64).T  # [S, E]
        ids, w = ref.softmax_topk(logits, k, normalize=True)
        gate, up, down = (np.asarray(p["experts"][n], np.float64) for n in ("gate_proj", "up_proj", "down_proj"))
        expert = lambda e, xs: ref.swiglu(xs, gate[e], up[e], down[e])  # [E, out, in] as HF stores them
        y = ref.moe_block(x, ids, w, expert)
        record.append({"layer": i, "shape": tuple(h.shape), "probs": ref.softmax(logits), "ids": ids})
        return jnp.asarray(y.reshape(h.shape), h.dtype), None

    return hook


@pytest.fixture(scope="module")
def reference(model, tokens):
    """The model's default (jitted) logits of tokens[:, :-1], and an eager forward whose MoE layers run the
    float64 NumPy reference: (default logits, reference logits, per-layer records)."""
    ids = jnp.asarray(tokens[:, :-1])
    ctx = causal_context(*ids.shape)
    default, _ = model.apply(model.params, ids, ctx)
    record = []
    hooked, _ = forward(model.params, ids, ctx, spec=model.spec, moe_configs=model.moe_configs,
                        moe_fn=_reference_moe_hook(model, record))
    return np.asarray(default), np.asarray(hooked), record


def _switch_loss(record, shards: int) -> float:
    """Sum over MoE layers of the switch loss, each the mean over `shards` equal token shards of the loss of
    that shard's tokens (what an expert-parallel layer reports: every device balances its own tokens)."""
    total = 0.0
    for r in record:
        probs, ids = np.split(r["probs"], shards), np.split(r["ids"], shards)
        total += float(np.mean([ref.switch_load_loss(p, i) for p, i in zip(probs, ids)]))
    return total


def test_moe_hook_against_the_float64_reference(model, tokens, reference):
    default, hooked, record = reference
    assert [(r["layer"], r["shape"]) for r in record] == [(0, (8, 8, 32)), (1, (8, 8, 32))]
    np.testing.assert_allclose(hooked, default, rtol=1e-5, atol=1e-5 * np.abs(default).max())
    # the hook is really what runs: zero MoE outputs change the logits
    ids = jnp.asarray(tokens[:, :-1])
    zero, _ = forward(model.params, ids, causal_context(*ids.shape), spec=model.spec, moe_configs=model.moe_configs,
                      moe_fn=lambda i, p, h: (jnp.zeros_like(h), None))
    assert np.abs(np.asarray(zero) - default).max() > 1e-2


def test_loss_metrics_and_eval_against_float64_references(model, tokens, reference):
    default, _, record = reference
    loss, m = jax.jit(functools.partial(lm_loss, model=model))(model.params, {"tokens": tokens})
    assert m["ce"].shape == () and m["dropped"].shape == (2,) and m["load"].shape == (2, 4)
    assert m["ce"].dtype == m["load"].dtype == m["dropped"].dtype == jnp.float32
    np.testing.assert_allclose(float(m["ce"]), _np_ce(default, tokens[:, 1:]), rtol=1e-5)
    np.testing.assert_allclose(float(m["l_aux"]), _switch_loss(record, 1), rtol=1e-5)
    np.testing.assert_allclose(float(loss), float(m["ce"]) + 0.01 * float(m["l_aux"]), rtol=1e-6)
    counts = [np.bincount(r["ids"].ravel(), minlength=4) for r in record]
    np.testing.assert_allclose(np.asarray(m["load"]), [c / c.sum() for c in counts], atol=1e-7)
    np.testing.assert_array_equal(np.asarray(m["dropped"]), 0.0)  # dropless

    ce = lm_eval(model.params, tokens, model=model)
    assert ce.shape == () and ce.dtype == jnp.float32
    np.testing.assert_allclose(float(ce), _np_ce(default, tokens[:, 1:]), rtol=1e-5)
    assert bits_per_byte(math.log(256.0)) == pytest.approx(8.0, rel=1e-12)
    with pytest.raises(ValueError, match=r"batch\['tokens'\] must be int token ids \[B, T \+ 1\]"):
        lm_loss(model.params, {"tokens": tokens[:, :1]}, None, model=model)
    with pytest.raises(ValueError, match="mapping with 'tokens'"):
        lm_loss(model.params, tokens, None, model=model)
    with pytest.raises(ValueError, match="lm_eval: tokens"):
        lm_eval(model.params, tokens.astype(np.float32), model=model)


def test_expert_parallel_loss_against_the_references(model, tokens, reference):
    """lm_loss with the trainer's MoE call (`MoECall`: 4-way expert parallel x 2 data shards over the 8 CPU
    devices, tokens split over all 8): the same ce and loads; l_aux is the mean of the 8 shards' own losses."""
    from tutel_jax.runtime._reconfigure import RuntimeConfig, plan_layout
    from tutel_jax.training._trainer import MoECall

    default, _, record = reference
    layout = plan_layout(moe_config(model), RuntimeConfig.ep(4, data=2))
    run = lambda p, b: lm_loss(p, b, MoECall(layout, jax.random.key(0), True), model=model, aux_weight=0.5)
    loss, m = jax.jit(run)(model.params, {"tokens": tokens})
    np.testing.assert_allclose(float(m["ce"]), _np_ce(default, tokens[:, 1:]), rtol=1e-5)
    np.testing.assert_allclose(float(m["l_aux"]), _switch_loss(record, 8), rtol=1e-5)
    np.testing.assert_allclose(float(loss), float(m["ce"]) + 0.5 * float(m["l_aux"]), rtol=1e-6)
    counts = [np.bincount(r["ids"].ravel(), minlength=4) for r in record]
    np.testing.assert_allclose(np.asarray(m["load"]), [c / c.sum() for c in counts], atol=1e-7)
    np.testing.assert_array_equal(np.asarray(m["dropped"]), 0.0)


def test_dense_baseline_loss():
    dense = init_lm(TINY.dense_baseline(), seed=1)
    toks = np.random.default_rng(1).integers(0, 256, (2, 9)).astype(np.int32)
    loss, m = jax.jit(functools.partial(lm_loss, model=dense))(dense.params, {"tokens": toks})
    logits, _ = dense.apply(dense.params, jnp.asarray(toks[:, :-1]), causal_context(2, 8))
    np.testing.assert_allclose(float(m["ce"]), _np_ce(np.asarray(logits), toks[:, 1:]), rtol=1e-5)
    assert float(loss) == float(m["ce"]) and float(m["l_aux"]) == 0.0
    assert m["dropped"].shape == (0,) and m["load"].shape == (0, 4)


# ------------------------------------------------------------------------------------------ tokenizer, export


def test_byte_symbols_are_the_bytelevel_alphabet():
    from tokenizers import pre_tokenizers

    symbols = byte_tokenizer.byte_symbols()
    assert len(set(symbols)) == 256 and set(symbols) == set(pre_tokenizers.ByteLevel.alphabet())
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    text = "def f():\n\treturn 'héllo ✓ 🐍' \x00\x7f"
    (piece, _), = pre.pre_tokenize_str(text)
    assert piece == "".join(symbols[b] for b in text.encode("utf-8"))
    tok = byte_tokenizer.build_tokenizer()
    assert tok.encode(text, add_special_tokens=False).ids == list(text.encode("utf-8")) == byte_tokenizer.encode(text)
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 40):  # random bytes, mostly invalid UTF-8: both decoders replace the same way
        ids = rng.integers(0, 256, n).tolist()
        assert tok.decode(ids) == byte_tokenizer.decode(ids), ids
    with pytest.raises(ValueError, match=r"ids must be bytes in \[0, 256\)"):
        byte_tokenizer.decode([1, 256])


@pytest.fixture(scope="module")
def exported(model, tmp_path_factory):
    params = init_lm(TINY, seed=1).params  # not the model's own params: export writes the ones given
    return export_lm(model, params, tmp_path_factory.mktemp("lm") / "out"), params


def test_export_round_trip_and_tokenizer(model, exported, tokens):
    path, params = exported
    loaded = from_pretrained(path)
    assert loaded.spec == model.spec and loaded.moe_configs == model.moe_configs  # the same forward program
    for (key, a), (_, b) in zip(*(jax.tree_util.tree_flatten_with_path(t)[0] for t in (loaded.params, params))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(key))
    ids = jnp.asarray(tokens[:, :-1])
    got, _ = model.apply(loaded.params, ids, causal_context(*ids.shape))
    want, _ = model.apply(params, ids, causal_context(*ids.shape))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert json.loads((path / "config.json").read_text()) == TINY.hf_config()
    from tutel_jax.serving._tokenizer import TextCodec, load_tokenizer

    assert load_tokenizer(path).encode("def f():", add_special_tokens=False).ids == list(b"def f():")
    codec = TextCodec(path)
    prompt = codec.chat_prompt([{"role": "user", "content": "hi ✓"}])
    assert byte_tokenizer.decode(prompt) == "user: hi ✓\nassistant: "
    with pytest.raises(ValueError, match="params do not have the model's layout"):
        export_lm(model, {"embed": params["embed"]}, path.parent / "bad")
    bad = jax.tree_util.tree_map(lambda a: a, params)
    bad["norm"] = jnp.zeros((3,))
    with pytest.raises(ValueError, match=r"params\['norm'\] has shape \(3,\)"):
        export_lm(model, bad, path.parent / "bad")
    assert not (path.parent / "bad").exists()


def test_served_chat_completion(exported):
    """In process: the server answers /v1/chat/completions of the exported folder with text (the chat template
    rendered, byte-tokenized; the answer's text is its token ids' bytes)."""
    pytest.importorskip("fastapi", reason="the server needs the `serve` extra (fastapi)")
    from fastapi.testclient import TestClient

    from tutel_jax.serving._server import ServerConfig, create_app

    path, _ = exported
    app = create_app(path, ServerConfig(max_batch_size=1, batching="bucketed"), model=from_pretrained(path),
                     warmup=False)
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "def"}],
                                                      "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == 3 and all(0 <= t < 256 for t in choice["token_ids"])
    assert choice["message"]["content"] == byte_tokenizer.decode(choice["token_ids"])
    assert body["usage"]["prompt_tokens"] == len("user: def\nassistant: ")


def test_hf_transformers_loads_the_export(model, exported, tokens):
    """Optional cross-check: HF transformers' Qwen3-MoE forward and tokenizer of the exported folder."""
    transformers = pytest.importorskip("transformers", reason="HF cross-check needs `transformers` (not installed "
                                       "by the test extra)")
    torch = pytest.importorskip("torch")
    path, params = exported
    ids = tokens[:, :-1]
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()
    ours, _ = model.apply(params, jnp.asarray(ids), causal_context(*ids.shape))  # = from_pretrained(path): above
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=0, atol=1e-4)
    dense = init_lm(TINY.dense_baseline(), seed=2)
    dense_path = export_lm(dense, dense.params, path.parent / "dense")
    hf_dense = transformers.Qwen3MoeForCausalLM.from_pretrained(dense_path).eval()
    with torch.no_grad():
        theirs = hf_dense(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()
    np.testing.assert_allclose(np.asarray(dense(ids)), theirs, rtol=0, atol=1e-4)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert tok("def f(): ✓", add_special_tokens=False)["input_ids"] == list("def f(): ✓".encode())
    assert tok.decode(list(b"def f():")) == "def f():"
