"""Whole HF MoE models (tests/fixtures/hf/<case>) loaded by `tutel_jax.models.from_pretrained`, against the
transformers 5.24 outputs in expected.npz: logits, the last MoE layer's routing, greedy generation (KV cache),
and batches of prompts of different lengths against each prompt alone. Tolerances: fixtures README."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tutel_jax.checkpoint import open_checkpoint
from tutel_jax.models import context_from_mask, from_pretrained
from pallas_kernels.quant.formats._fp8_block import dequant_fp8_block_numpy
from pallas_kernels.quant.formats._mxfp4 import dequant_mxfp4_numpy
from pallas_kernels.quant.formats._nvfp4 import dequant_nvfp4_numpy
from tutel_jax.serving import generate, left_align
from support.paths import HF, REPO
from support.exact_paths import FLOAT_ACTIVATIONS

CASES = ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "glm4_moe", "gpt_oss", "olmoe"]
QUANT_CASES = ["deepseek_v3_fp8", "gpt_oss_mxfp4", "qwen3_moe_nvfp4"]  # kept quantized in memory
TOL = dict(rtol=1e-4, atol=1e-4)
_MODELS: dict = {}


def _load(case):
    if case not in _MODELS:
        # FP4 cases: float32 activations (the CPU default multiplies them by int8 ones: test_native_q8)
        options = FLOAT_ACTIVATIONS if case in QUANT_CASES else {}
        _MODELS[case] = from_pretrained(HF / case, **options), dict(np.load(HF / case / "expected.npz"))
    return _MODELS[case]


@pytest.mark.parametrize("case", CASES + QUANT_CASES)
def test_logits_and_router_match_hf(case):
    model, e = _load(case)
    ids = jnp.asarray(e["input_ids"])
    logits, _, (rid, rw) = model.apply(model.params, ids, context_from_mask(jnp.ones(ids.shape, bool)),
                                       return_router=True)
    assert logits.dtype == jnp.float32 and logits.shape == e["logits"].shape
    np.testing.assert_allclose(np.asarray(logits), e["logits"], **TOL)
    rid, rw = np.asarray(rid), np.asarray(rw)
    order = np.argsort(rid, axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(rid, order, -1), e["router_topk_ids"])
    np.testing.assert_allclose(np.take_along_axis(rw, order, -1), e["router_topk_weights"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_greedy_generation_and_ragged_batch(case):
    model, e = _load(case)
    prompts, T = e["input_ids"], e["input_ids"].shape[1]
    out = generate(model, prompts, 8, return_logits=True)
    np.testing.assert_array_equal(out.sequences, e["greedy"])
    np.testing.assert_allclose(out.logits, e["greedy_logits"], **TOL)
    # prompt 0 cut to 7 tokens next to the full prompt 1, right- and left-padded: each row as if alone
    n = 7
    right = prompts.copy()
    right[0, n:] = 3
    mask_r = np.ones_like(right)
    mask_r[0, n:] = 0
    left = prompts.copy()
    left[0] = np.concatenate([np.full(T - n, 5), prompts[0, :n]])
    mask_l = np.ones_like(left)
    mask_l[0, :T - n] = 0
    alone = generate(model, prompts[:1, :n], 8, return_logits=True)
    for ids, mask in ((right, mask_r), (left, mask_l)):
        got = generate(model, ids, 8, attention_mask=mask, return_logits=True)
        np.testing.assert_array_equal(got.tokens[1], e["greedy"][1, T:])
        np.testing.assert_array_equal(got.tokens[0], alone.tokens[0])
        np.testing.assert_allclose(got.logits[0], alone.logits[0], **TOL)
        np.testing.assert_array_equal(got.prompt_lengths, [n, T])
        np.testing.assert_array_equal(got.sequences[0, T - n:T], prompts[0, :n])


@pytest.mark.parametrize("case", QUANT_CASES)
def test_quantized_greedy_on_device_loop(case):
    model, e = _load(case)
    out = generate(model, e["input_ids"], 8, return_logits=True, on_device=True)
    np.testing.assert_array_equal(out.sequences, e["greedy"])
    np.testing.assert_allclose(out.logits, e["greedy_logits"], **TOL)


def test_dequant_formulas():
    """Unsigned E8M0 scales (>= 128), low nibble first, partial FP8 edge blocks, NVFP4 divide-by-global."""
    blocks = np.zeros((1, 1, 16), np.uint8)
    blocks[0, 0, 0] = 0x71  # element 0: code 1 (0.5), element 1: code 7 (6)
    scales = np.array([[130]], np.uint8)
    w = dequant_mxfp4_numpy(blocks, scales)
    assert w.shape == (1, 32) and w[0, 0] == 0.5 * 8 and w[0, 1] == 6 * 8 and not w[0, 2:].any()
    fp8 = np.full((130, 3), 2.0, np.float32).astype(ml_dtypes.float8_e4m3fn)
    d = dequant_fp8_block_numpy(fp8, np.array([[0.5], [3.0]], np.float32))
    assert d[127, 0] == 1.0 and d[128, 2] == 6.0 and d.shape == (130, 3)
    nv = dequant_nvfp4_numpy(np.array([[0xF2] * 8], np.uint8), np.array([[6.0]], ml_dtypes.float8_e4m3fn),
                       np.array([2.0], np.float32))
    np.testing.assert_array_equal(nv[0, :2], [1.0 * 3, -6.0 * 3])
    with pytest.raises(ValueError, match="blocks"):
        dequant_fp8_block_numpy(fp8, np.ones((1, 1), np.float32))


def test_padded_forward_matches_unpadded():
    model, e = _load("qwen3_moe")
    ids, n = e["input_ids"], 9
    mask = np.ones_like(ids)
    mask[0, n:] = 0
    logits = np.asarray(model(ids, mask))
    np.testing.assert_allclose(logits[1], e["logits"][1], **TOL)
    # causal: the first n positions of a right-padded row equal the full row's first n positions
    np.testing.assert_allclose(logits[0, :n], e["logits"][0, :n], **TOL)


def test_eos_pads_the_rest_of_a_row():
    model, e = _load("qwen3_moe")
    T, greedy = e["input_ids"].shape[1], e["greedy"][:, 12:]
    eos = int(greedy[0, 2])
    out = generate(model, e["input_ids"], 8, eos_token_id=eos, pad_token_id=0)
    for b in range(2):
        hits = np.flatnonzero(greedy[b] == eos)
        stop = hits[0] + 1 if len(hits) else 8
        np.testing.assert_array_equal(out.tokens[b, :stop], greedy[b, :stop])
        assert (out.tokens[b, stop:] == 0).all()
    assert out.sequences.shape == (2, T + 8)


def test_seeded_sampling():
    model, e = _load("qwen3_moe")
    ids = e["input_ids"]
    top1 = generate(model, ids, 4, temperature=1.0, top_k=1, seed=3)
    np.testing.assert_array_equal(top1.sequences, e["greedy"][:, :ids.shape[1] + 4])
    a = generate(model, ids, 4, temperature=2.0, top_p=0.9, seed=1)
    b = generate(model, ids, 4, temperature=2.0, top_p=0.9, seed=1)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.tokens.min() >= 0 and a.tokens.max() < 128


def test_nnx_wrapper_forward_and_train_step():
    import optax
    from flax import nnx

    from tutel_jax.nn import NNXCausalLM
    model, e = _load("deepseek_v3")
    m = NNXCausalLM(model)
    ids = e["input_ids"]
    np.testing.assert_allclose(np.asarray(nnx.jit(lambda m, x: m(x))(m, ids)), e["logits"], **TOL)

    def loss(m):
        logp = jax.nn.log_softmax(m(ids[:, :-1]))
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], -1))

    @nnx.jit
    def step(m, opt):
        value, grads = nnx.value_and_grad(loss)(m)
        opt.update(m, grads)
        return value

    bias = np.asarray(m.params["layers"][1]["moe"]["gates"][0]["e_score_correction_bias"][...])
    opt = nnx.Optimizer(m, optax.sgd(0.05), wrt=nnx.Param)
    before, after = float(step(m, opt)), float(step(m, opt))
    assert after < before
    # the router's correction bias is RouterState, not a Param: the optimizer leaves it alone
    np.testing.assert_array_equal(m.params["layers"][1]["moe"]["gates"][0]["e_score_correction_bias"][...], bias)


def test_example_script(capsys):
    import importlib.util
    spec = importlib.util.spec_from_file_location("gen_example", REPO / "examples" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    e = np.load(HF / "mixtral" / "expected.npz")
    prompt = ",".join(str(t) for t in e["input_ids"][1])
    assert mod.main([str(HF / "mixtral"), "--ids", prompt, "--ids", "1,2,3", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert f"-> {e['greedy'][1, 12:].tolist()}" in out and "tokens/s" in out


def test_left_align_and_errors():
    ids = np.array([[1, 2, 0], [4, 5, 6]])
    out, mask, lengths = left_align(ids, np.array([[1, 1, 0], [1, 1, 1]]), pad_token_id=9)
    np.testing.assert_array_equal(out, [[9, 1, 2], [4, 5, 6]])
    np.testing.assert_array_equal(lengths, [2, 3])
    with pytest.raises(ValueError, match="contiguous"):
        left_align(ids, np.array([[1, 0, 1], [1, 1, 1]]))
    with pytest.raises(ValueError, match="at least one token"):
        left_align(ids, np.array([[0, 0, 0], [1, 1, 1]]))


def test_sharded_checkpoint_loads_the_same_params(tmp_path):
    from safetensors.numpy import save_file
    tensors = dict(open_checkpoint(HF / "mixtral"))
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(tmp_path / shard))
        weight_map.update({n: shard for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(HF / "mixtral" / "config.json", tmp_path / "config.json")
    sharded, single = from_pretrained(tmp_path), from_pretrained(HF / "mixtral")
    assert jax.tree.structure(sharded.params) == jax.tree.structure(single.params)
    for a, b in zip(jax.tree.leaves(sharded.params), jax.tree.leaves(single.params)):
        np.testing.assert_array_equal(a, b)


def test_unknown_model_type_and_missing_tensor(tmp_path):
    shutil.copy(HF / "mixtral" / "model.safetensors", tmp_path / "model.safetensors")
    config = json.loads((HF / "mixtral" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, model_type="llama4_text")))
    with pytest.raises(ValueError, match="unsupported model_type 'llama4_text'"):
        from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = dict(open_checkpoint(tmp_path))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match="model.layers.1.self_attn.k_proj.weight"):
        from_pretrained(tmp_path, tensors=tensors)
    with pytest.raises(ValueError, match="no config.json"):
        from_pretrained(tmp_path / "missing")


def test_olmoe_refuses_clip_qkv(tmp_path):
    shutil.copy(HF / "olmoe" / "model.safetensors", tmp_path / "model.safetensors")
    config = json.loads((HF / "olmoe" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, clip_qkv=8.0)))
    with pytest.raises(ValueError, match="clip_qkv=8.0 is not supported"):
        from_pretrained(tmp_path)


def test_one_registered_module_per_family():
    from tutel_jax.models import FAMILIES
    from tutel_jax.models.families import family_names, get_family
    modules = sorted(p.stem.lstrip("_") for p in (REPO / "tutel_jax" / "models" / "families").glob("_*.py")
                     if p.stem != "__init__")
    names = [n for n in family_names() if get_family(n).name == n]
    assert sorted(names) == modules and FAMILIES == family_names()
    assert get_family("kimi_k2") is get_family("deepseek_v3") and get_family("llama") is None
    assert all((HF / n / "expected.npz").is_file() for n in names)
