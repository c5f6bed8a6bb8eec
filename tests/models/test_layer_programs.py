"""Per-layer programs (`models.layer_programs`): the same logits, caches and tokens as the whole-model program,
and a compile count set by the kinds of layers, not the depth."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tutel_jax.models import from_pretrained, context_from_mask, AttnContext, random_hf_tensors
from tutel_jax.models import _layer_programs as layer_programs
from tutel_jax.models._causal_lm import PER_LAYER_MIN_LAYERS
from tutel_jax.serving import generate
from tutel_jax.serving._continuous import ContinuousBatcher, Request
from support.paths import HF



def _pair(family: str):
    path = HF / family
    return from_pretrained(path, per_layer_jit=False), from_pretrained(path, per_layer_jit=True)


def _deep_gpt_oss(tmp_path: Path, layers: int):
    """The gpt_oss fixture's widths with `layers` layers (alternating sliding / full), random weights."""
    config = json.loads((HF / "gpt_oss" / "config.json").read_text())
    config.update(num_hidden_layers=layers, layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path, random_hf_tensors(config, seed=layers)


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])  # sliding / full kinds; MLA with a dense layer
def test_logits_and_cache_equal_the_whole_program(family):
    whole, per_layer = _pair(family)
    assert not whole.per_layer_jit and per_layer.per_layer_jit
    ids = jnp.asarray(np.random.default_rng(0).integers(0, whole.spec.vocab_size, (2, 7)), jnp.int32)
    mask = jnp.ones(ids.shape, bool).at[1, :2].set(False)  # left padding
    np.testing.assert_allclose(per_layer(ids, mask), whole(ids, mask), rtol=1e-5, atol=1e-5)
    # with a cache: the updated cache too, and the caller's cache stays valid (not donated)
    ctx = AttnContext(jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (2, 7)), jnp.int32(0),
                      jnp.ones((2, 16), bool))
    cache = per_layer.init_cache(2, 16)
    a, ca = whole.apply(whole.params, ids, ctx, cache)
    b, cb = per_layer.apply(per_layer.params, ids, ctx, cache)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    for x, y in zip(jax.tree.leaves(cb), jax.tree.leaves(ca)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(cache))


def test_generate_and_continuous_batching_give_the_same_tokens():
    whole, per_layer = _pair("gpt_oss")
    rng = np.random.default_rng(1)
    ids = rng.integers(0, whole.spec.vocab_size, (2, 6))
    ref = generate(whole, ids, 12, return_logits=True)
    got = generate(per_layer, ids, 12, return_logits=True)  # host loop: the steps run unjitted
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    np.testing.assert_allclose(got.logits, ref.logits, rtol=1e-5, atol=1e-5)
    on_device = generate(per_layer, ids, 12, on_device=True)  # traced inside one program
    np.testing.assert_array_equal(on_device.tokens, ref.tokens)

    batcher = ContinuousBatcher(per_layer, max_batch_size=4, max_len=32)  # (greedy rows equal generate)
    reqs = [batcher.add(Request(prompt=list(p), max_new_tokens=8)) for p in ids]
    while not batcher.idle:
        batcher.step()
    assert [r.tokens for r in reqs] == [list(t[:8]) for t in ref.tokens]


def test_compiles_once_per_kind_of_layer_whatever_the_depth(tmp_path):
    counts = {}
    for layers in (4, 8):
        (tmp_path / str(layers)).mkdir()
        path, tensors = _deep_gpt_oss(tmp_path / str(layers), layers)
        model = from_pretrained(path, tensors=tensors, per_layer_jit=True)
        assert model.forward_fn.kinds() == 1  # blocks of a sliding and a full layer
        before = model.forward_fn.compiled_layer_programs()
        ids = jnp.zeros((1, 3 + layers), jnp.int32)  # a shape of its own: nothing compiled before
        model(ids)
        model(ids + 1)
        counts[layers] = model.forward_fn.compiled_layer_programs() - before
    assert counts == {4: 1, 8: 1}


@pytest.mark.parametrize("depth, pattern, size", [
    (24, "sf", 8),   # GPT-OSS-20B: four (sliding, full) pairs, 3 programs a step
    (36, "sf", 6),   # GPT-OSS-120B: the largest whole repeat up to 8 that divides the depth
    (48, "m", 8),    # Qwen3-30B-A3B
    (94, "m", 8),    # Qwen3-235B: no divisor from 4 to 8, so blocks of 8 and a last block of 6
    (10, "sf", 8),
    (4, "sf", 4),    # a shallow model: one block
    (61, "ddd" + "m" * 58, 8),  # DeepSeek-V3: no short period, blocks of 8 (a program per distinct block)
])
def test_default_block_size(depth, pattern, size):
    kinds = (pattern * depth)[:depth]
    spec = type("Spec", (), {"windows": tuple(kinds)})()
    programs = layer_programs.LayerPrograms(spec, (None,) * depth)
    assert programs.block_size() == size <= layer_programs.MAX_LAYERS_PER_PROGRAM


@pytest.mark.parametrize("layers_per_program, kinds", [(1, 2), (3, 3)])  # a layer each; blocks of 3 (+ 2)
def test_other_block_sizes_give_the_same_logits(tmp_path, layers_per_program, kinds):
    path, tensors = _deep_gpt_oss(tmp_path, 8)
    whole = from_pretrained(path, tensors=tensors, per_layer_jit=False)
    blocks = layer_programs.LayerPrograms(whole.spec, whole.moe_configs, layers_per_program=layers_per_program)
    assert blocks.kinds() == kinds  # (sliding, full) or (s, f, s), (f, s, f) and the last (s, f)
    ids = jnp.asarray(np.arange(10).reshape(2, 5), jnp.int32)
    ctx = context_from_mask(jnp.ones((2, 5)))
    np.testing.assert_allclose(blocks(whole.params, ids, ctx)[0], whole.apply(whole.params, ids, ctx)[0],
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="layers_per_program"):
        layer_programs.LayerPrograms(whole.spec, whole.moe_configs, layers_per_program=0)


def test_auto_picks_per_layer_programs_for_deep_models(tmp_path):
    assert not from_pretrained(HF / "gpt_oss").per_layer_jit  # 2 layers
    (tmp_path / "shallower").mkdir()
    path, tensors = _deep_gpt_oss(tmp_path / "shallower", PER_LAYER_MIN_LAYERS - 2)
    assert not from_pretrained(path, tensors=tensors).per_layer_jit  # one program below the threshold
    (tmp_path / "deep").mkdir()
    path, tensors = _deep_gpt_oss(tmp_path / "deep", PER_LAYER_MIN_LAYERS)
    deep = from_pretrained(path, tensors=tensors)
    assert deep.per_layer_jit and isinstance(deep.forward_fn, layer_programs.LayerPrograms)
    ids = jnp.asarray(np.arange(10).reshape(2, 5), jnp.int32)
    whole = from_pretrained(path, tensors=tensors, per_layer_jit=False)
    np.testing.assert_allclose(deep(ids), whole(ids), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(deep(ids), deep.apply(deep.params, ids, context_from_mask(jnp.ones((2, 5))))[0])


def test_bad_per_layer_jit_value_is_refused():
    with pytest.raises(ValueError, match="per_layer_jit"):
        from_pretrained(HF / "gpt_oss", per_layer_jit="yes")
