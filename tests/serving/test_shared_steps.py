"""One generation engine: `generate` (host loop and on device), continuous batching and so both server engines
run the same prefill / decode / sample code (`tutel_jax.serving._steps`), and give the same tokens for prompts
of mixed lengths, greedy or seeded, with a logit bias."""

from __future__ import annotations

import importlib

import jax
import numpy as np
import pytest

from support.paths import HF
from tutel_jax.models import from_pretrained
from tutel_jax.serving import generate, left_align, _steps as steps
from tutel_jax.serving._continuous import ContinuousBatcher, Request
from tutel_jax.serving._generate import left_pad

gen_module = importlib.import_module("tutel_jax.serving._generate")  # the module (the package exports the function)
continuous_module = importlib.import_module("tutel_jax.serving._continuous")


def test_generate_and_continuous_batching_share_the_step_code():
    assert gen_module.decode_step is continuous_module.decode_step is steps.decode_step
    assert gen_module.prefill_step is steps.prefill_step and steps.prefill_step.body is steps.prefill_body
    assert continuous_module.prefill_body is steps.prefill_body  # inside its admission of a group of rows
    assert gen_module.sample_rows is steps.sample_rows  # still importable from generate


def test_left_pad_and_left_align():
    ids, mask, lengths = left_pad([[1, 2], [3]], pad_token_id=9, width=4)
    np.testing.assert_array_equal(ids, [[9, 9, 1, 2], [9, 9, 9, 3]])
    np.testing.assert_array_equal(mask, [[0, 0, 1, 1], [0, 0, 0, 1]])
    np.testing.assert_array_equal(lengths, [2, 1])
    right = np.array([[1, 2, 0, 0], [3, 0, 0, 0]])
    for got, want in zip(left_align(right, right > 0, pad_token_id=9), (ids, mask, lengths)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("sampled", [False, True])
def test_both_paths_give_the_same_tokens_for_mixed_prompt_lengths(model, sampled):
    """Row b of a `generate` batch of right-padded prompts of different lengths and `Request(seed, sample_id=b)`
    in a continuous batcher draw the same tokens, a logit bias included (generate on device as well)."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, model.config["vocab_size"], size=n).tolist() for n in (3, 17, 1, 9)]
    kw = dict(temperature=0.9, top_k=40, top_p=0.95) if sampled else {}
    bias = {7: 4.0, 11: -3.0, 30: 2.5}
    ids, mask = np.zeros((4, 17), np.int32), np.zeros((4, 17), np.int32)
    for b, p in enumerate(prompts):
        ids[b, :len(p)], mask[b, :len(p)] = p, 1
    offline = generate(model, ids, 10, attention_mask=mask, seed=5, logit_bias=bias, **kw).tokens
    scanned = generate(model, ids, 10, attention_mask=mask, seed=5, logit_bias=bias, on_device=True, **kw).tokens
    np.testing.assert_array_equal(scanned, offline)
    reqs = [Request(p, 10, seed=5, sample_id=b, logit_bias=bias, **kw) for b, p in enumerate(prompts)]
    batcher = ContinuousBatcher(model, max_batch_size=4, max_len=32)
    for req in reqs:
        batcher.add(req)
    batcher.run()
    assert [r.tokens for r in reqs] == offline.tolist()


@pytest.mark.parametrize("per_layer_jit", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_warm_generate_compiles_nothing(per_layer_jit, temperature):
    """Once a batch shape has run, `generate` again compiles no program: with per-layer programs too, where the
    step bodies run eagerly around them (the sampler is one compiled program, not traced again at each step)."""
    model = from_pretrained(HF / "qwen3_moe", per_layer_jit=per_layer_jit)
    ids = np.array([[3, 17, 42, 5]], np.int32)
    generate(model, ids, 6, temperature=temperature, seed=1)
    compiled = []

    def listen(event: str, *_args, **_kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        generate(model, ids, 6, temperature=temperature, seed=2)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiled == []


def test_the_steps_tell_the_model_which_tokens_are_real():
    """A prefill marks its padding columns (left padding, right padding after `last_at`) and dead rows, a decode
    its free rows, as not real (`AttnContext.query_valid`), so that MoE layers route none of them; a prefill
    without padding leaves the mask out (None: every token real)."""
    seen = []

    def apply(params, ids, ctx, cache, logits_at=None):
        seen.append(None if ctx.query_valid is None else np.asarray(ctx.query_valid))
        return jax.numpy.zeros((ids.shape[0], 1, 8)), cache

    cache = [jax.numpy.zeros((3, 1, 6, 2))]
    sampling = steps.sampling_arrays([steps.row_sampling(0, 0, 0.0, None, None, None)] * 3)
    ids = np.zeros((3, 4), np.int32)
    steps.prefill_body(apply, None, ids, cache, sampling)
    steps.prefill_body(apply, None, ids, cache, sampling, pad=np.array([0, 2, 3]))
    steps.prefill_body(apply, None, ids, cache, sampling, last_at=np.array([3, 1, 0]), live=np.array([1, 1, 0], bool))
    steps.decode_body(apply, None, np.zeros(3, np.int32), np.array([4, 4, 4]), np.array([1, 1, 0]), cache, sampling,
                      live=np.array([True, True, False]))
    assert seen[0] is None
    np.testing.assert_array_equal(seen[1], [[1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1]])
    np.testing.assert_array_equal(seen[2], [[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(seen[3], [[True], [True], [False]])
