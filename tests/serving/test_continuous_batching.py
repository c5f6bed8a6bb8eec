"""Continuous batching (tutel_jax.serving._continuous) without HTTP: per-row cache indices in the attention
layers, greedy rows equal offline `generate` whenever they are admitted, rows are reused, seeded sampling does
not depend on the other rows, and the decode step compiles once."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tutel_jax.models._layers import AttnContext, attend, write_cache
from tutel_jax.serving import generate
from tutel_jax.serving._continuous import TRACES, ContinuousBatcher, Request, prompt_bucket
from tutel_jax.serving import sample_rows
from tutel_jax.serving._steps import greedy_tokens
from support.paths import HF



def _prompts(lengths, seed=0, vocab=128):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


def _references(model, prompts, n):
    """Offline greedy `generate` of each prompt, n tokens (one batched call: each row equals its prompt run
    alone; padded to one shape, [8, 32] x 40 tokens, so that it compiles once for the whole file)."""
    assert len(prompts) <= 8 and max(map(len, prompts)) <= 32 and n <= 40
    ids, mask = np.zeros((8, 32), np.int32), np.zeros((8, 32), np.int32)
    mask[:, 0] = 1
    for b, p in enumerate(prompts):
        ids[b, :len(p)], mask[b, :len(p)] = p, 1
    return [t[:n] for t in generate(model, ids, 40, attention_mask=mask).tokens.tolist()[:len(prompts)]]


def _run(batcher, schedule):
    """Adds schedule[step] (a list of Requests) before each step, then steps until idle: the step at which
    each request finished, by id."""
    finished_at, step = {}, 0
    while step < len(schedule) or not batcher.idle:
        for req in schedule[step] if step < len(schedule) else []:
            batcher.add(req)
        for req in batcher.step():
            finished_at[id(req)] = step
        step += 1
    return finished_at


def test_vector_index_equals_per_row_scalar_index():
    """write_cache / attend with index [B] equal each row run with its own scalar index (window included;
    the cache bit for bit, attention within float32 rounding)."""
    rng = np.random.default_rng(0)
    B, T, L, H, D = 3, 2, 10, 2, 4
    cache = jnp.asarray(rng.normal(size=(B, H, L, D)), jnp.float32)
    new = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(B, T, 2 * H, D)), jnp.float32)
    index = jnp.asarray([0, 5, 8], jnp.int32)
    valid = jnp.asarray(rng.random((B, L)) > 0.2)
    out = write_cache(cache, new, index)
    ctx = AttnContext(index[:, None] + jnp.arange(T), index, valid)
    att = attend(q, out, out, ctx, 0.5, window=4)
    for b in range(B):
        ref = write_cache(cache[b:b + 1], new[b:b + 1], index[b])
        np.testing.assert_array_equal(out[b:b + 1], ref)
        ctx_b = AttnContext(ctx.positions[b:b + 1], index[b], valid[b:b + 1])
        # float32: a batch of 3 and a batch of 1 may round the attention matmuls differently (last bit)
        np.testing.assert_allclose(att[b:b + 1], attend(q[b:b + 1], ref, ref, ctx_b, 0.5, window=4),
                                   rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_greedy_equals_generate_when_admitted_at_any_step(family, model):
    """Prompts of different lengths admitted at different steps (some while others are mid-decode, one into a
    row another request used before) each equal offline `generate` of that prompt alone."""
    if family != "qwen3_moe":  # gpt_oss: sliding window + sinks through the per-row masks
        from tutel_jax.models import from_pretrained
        model = from_pretrained(HF / family)
    prompts = _prompts([3, 17, 1, 30, 9], vocab=model.config["vocab_size"])
    limits = [12, 6, 10, 8, 12]
    reqs = [Request(p, n) for p, n in zip(prompts, limits)]
    batcher = ContinuousBatcher(model, max_batch_size=3, max_len=64)
    _run(batcher, [[reqs[0]], [], [reqs[1]], [reqs[2]], [], [], [reqs[3], reqs[4]]])
    for req, ref, n in zip(reqs, _references(model, prompts, max(limits)), limits):
        assert req.finished and req.finish_reason == "length"
        assert req.tokens == ref[:n]


def test_seeded_sampling_equals_generate(model):
    """One sampler: row b of a seeded `generate` batch and `Request(seed, sample_id=b)` draw the same tokens
    (the key of token n is fold_in(fold_in(key(seed), b), n) on both paths)."""
    prompts = _prompts([7], seed=4, vocab=model.config["vocab_size"]) * 3
    kw = dict(temperature=1.5, top_k=20, top_p=0.95)
    offline = generate(model, np.asarray(prompts), 10, seed=11, **kw).tokens.tolist()
    reqs = [Request(p, 10, seed=11, sample_id=b, **kw) for b, p in enumerate(prompts)]
    _run(ContinuousBatcher(model, max_batch_size=4, max_len=32), [reqs])
    assert [r.tokens for r in reqs] == offline
    assert len({tuple(t) for t in offline}) == 3  # the same prompt three times: three different samples


def test_request_admitted_mid_flight_finishes_first(model):
    long, short = Request(_prompts([5])[0], 40), Request(_prompts([4], seed=1)[0], 3)
    batcher = ContinuousBatcher(model, max_batch_size=3, max_len=64)
    finished_at = _run(batcher, [[long], [], [], [], [], [short]])
    # admitted at step 5 (prefill + decode: 2 tokens), its 3rd token at step 6
    assert finished_at[id(short)] == 6 < finished_at[id(long)]
    ref_long, ref_short = _references(model, [long.prompt, short.prompt], 40)
    assert short.tokens == ref_short[:3] and long.tokens == ref_long


def test_rows_are_reused_and_stop_tokens_finish_early(model):
    """Six requests through three rows: every row is reused (stale cache slots never leak into a new request),
    stop tokens finish a request with the stop token kept, on_token returning True finishes it too."""
    prompts = _prompts([6, 2, 11, 4, 8, 3], seed=2)
    refs = _references(model, prompts, 10)
    seen = []
    reqs = [Request(p, 10) for p in prompts]
    reqs[1].stop_token_ids = frozenset({refs[1][3]})
    reqs[2].on_token = lambda t: (seen.append(t), len(seen) == 5)[1]
    batcher = ContinuousBatcher(model, max_batch_size=3, max_len=64)
    rows = []
    for req in reqs:
        batcher.add(req)
    while not batcher.idle:
        batcher.step()
        rows += [r.row for r in batcher.running]
    assert set(rows) == {0, 1, 2}
    stop_at = refs[1].index(refs[1][3]) + 1
    assert reqs[1].tokens == refs[1][:stop_at] and reqs[1].finish_reason == "stop"
    assert reqs[2].tokens == refs[2][:5] == seen and reqs[2].finish_reason == "callback"
    for k in (0, 3, 4, 5):
        assert reqs[k].tokens == refs[k] and reqs[k].finish_reason == "length"


def test_seeded_sampling_does_not_depend_on_other_rows(model):
    """A seeded request gives the same tokens alone and beside other (greedy and sampled) traffic, admitted at
    another step into another row; other seeds / sample ids give other tokens."""
    prompt = _prompts([7], seed=3)[0]

    def sampled(seed=42, sample_id=0):
        return Request(prompt, 12, temperature=0.9, top_k=50, top_p=0.95, seed=seed, sample_id=sample_id)

    alone = sampled()
    _run(ContinuousBatcher(model, max_batch_size=3, max_len=64), [[alone]])
    busy = sampled()
    others = [Request(p, 20, temperature=t, seed=s) for p, t, s in
              zip(_prompts([3, 9, 5], seed=4), [0.0, 1.3, 0.7], [1, 2, 3])]
    _run(ContinuousBatcher(model, max_batch_size=3, max_len=64), [others[:2], [], [], [busy, others[2]]])
    assert busy.row != alone.row and busy.tokens == alone.tokens
    assert len(set(alone.tokens)) > 1
    variants = [sampled(seed=7), sampled(sample_id=1)]
    _run(ContinuousBatcher(model, max_batch_size=3, max_len=64), [variants])
    assert all(v.tokens != alone.tokens for v in variants)


def test_sample_rows_per_row_parameters():
    """Greedy rows are the argmax; top_k=1 is the argmax at any temperature; a row's sample does not change
    when the other rows change."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, 50)) * 3, jnp.float32)
    keys = jax.random.split(jax.random.key(0), 4)
    temp = jnp.asarray([0.0, 1.0, 0.8, 1.5])
    top_k = jnp.asarray([0, 1, 0, 5], jnp.int32)
    top_p = jnp.asarray([1.0, 1.0, 0.5, 0.9])
    tok = np.asarray(sample_rows(logits, keys, temp, top_k, top_p))
    argmax = np.asarray(jnp.argmax(logits, -1))
    assert tok[0] == argmax[0] and tok[1] == argmax[1]
    assert tok[3] in np.argsort(-np.asarray(logits[3]))[:5]
    other = sample_rows(logits.at[:2].set(0.0), keys, temp.at[0].set(1.0), top_k, top_p)
    np.testing.assert_array_equal(np.asarray(other)[2:], tok[2:])


def test_greedy_tokens_are_numpy_argmax():
    """The greedy token is NumPy's argmax of each row: the first of tied maxima, an inf, the first NaN (over an
    inf), a row of -inf (0), and rows of a large vocabulary."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 1000)).astype(np.float32)
    x[1, [5, 7]] = np.nan
    x[2] = -np.inf
    x[3, 3] = np.inf
    x[4] = 1.0
    x[5, [9, 11]] = [np.inf, np.nan]
    x[6, [40, 700]] = 9.0
    x[7, [999]] = np.inf
    np.testing.assert_array_equal(np.asarray(jax.jit(greedy_tokens)(x)), np.argmax(x, -1))
    big = rng.normal(size=(3, 201088)).astype(np.float32)
    got = jax.jit(greedy_tokens)(big)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.argmax(big, -1))


def test_decode_step_compiles_once(model):
    """Admissions, finishes and reused rows never recompile the decode step (nor a prefill of the same group
    size and bucket); with row_buckets, the decode step compiles once per power-of-two row count."""
    batcher = ContinuousBatcher(model, max_batch_size=5, max_len=24)  # a shape no other test uses
    before = TRACES["decode"], TRACES["prefill"]
    _run(batcher, [[Request([3, 1, 4], 6)], [], [Request(_prompts([5])[0], 3)], [], [Request([1], 4)]])
    assert (TRACES["decode"] - before[0], TRACES["prefill"] - before[1]) == (1, 1)
    _run(batcher, [[Request(p, 5)] for p in _prompts([12, 3, 16], seed=6)])
    assert (TRACES["decode"] - before[0], TRACES["prefill"] - before[1]) == (1, 1)

    prompts = _prompts([3, 9, 5], seed=7)
    refs = _references(model, prompts, 8)  # before counting: `generate` runs the same (counted) decode step
    batcher = ContinuousBatcher(model, max_batch_size=5, max_len=24, row_buckets=True)
    before = TRACES["decode"]
    for _ in range(2):  # rows 0 (1 row runs), 0-1 (2 run), 0-3 (4 run), 0-4 (5: all, compiled above)
        reqs = [Request(p, 8) for p in prompts] + [Request([1], 6), Request([2], 4), Request([5], 4)]
        _run(batcher, [[reqs[0]], [reqs[1]], reqs[2:4], reqs[4:]])
        assert TRACES["decode"] - before == 3
        assert [r.tokens for r in reqs[:3]] == refs  # rows left out of a step keep their cache
    assert prompt_bucket(1, 40) == 16 and prompt_bucket(17, 40) == 32 and prompt_bucket(33, 40) == 40


def test_requests_that_cannot_fit_a_row_are_refused(model):
    batcher = ContinuousBatcher(model, max_batch_size=1, max_len=16)
    batcher.add(Request([1] * 10, 7))  # 10 + 7 - 1 = 16 slots: fits
    for bad in (Request([1] * 10, 8), Request([], 1), Request([1], 0)):
        with pytest.raises(ValueError):
            batcher.add(bad)


@pytest.mark.parametrize("wait_ms, last_step_s", [(0.0, 0.0), (2000.0, 0.0), (0.0, 4.0)])
def test_an_idle_engine_prefills_requests_sent_together_once(model, wait_ms, last_step_s):
    """The server's continuous engine gathers jobs after the first one into an idle engine, for batch_wait_ms
    or a quarter of its last decode step (here set to last_step_s), whichever is longer: four requests sent
    together share one prefill (without a wait the first one is prefilled alone); every row still equals
    offline `generate`."""
    import concurrent.futures
    import threading

    from tutel_jax.serving._engines import GATHER_STEP_FRACTION, ContinuousEngine, Job
    from tutel_jax.serving._server_config import ServerConfig

    prompts = _prompts([3, 5, 4, 6], seed=3)
    ref = _references(model, prompts, 3)
    engine = ContinuousEngine(model, ServerConfig(max_batch_size=4, batch_wait_ms=wait_ms), max_len=32)
    engine.start()
    engine.batcher.last_decode_s = last_step_s
    assert engine.gather_window_s() == max(wait_ms / 1000, GATHER_STEP_FRACTION * last_step_s)
    try:
        jobs = [Job([p], 1, 3, 0.0, None, None, concurrent.futures.Future()) for p in prompts]
        engine.submit(jobs[0])  # wakes the idle worker; the others follow from another thread, a little later
        later = threading.Thread(target=lambda: [time.sleep(0.2) or engine.submit(j) for j in jobs[1:]])
        later.start()
        later.join()
        assert [j.future.result(timeout=300)[0][0] for j in jobs] == ref
        prefills = engine.stats()["prefills"]
        assert engine.batcher.last_decode_s > 0  # the steps that ran set it
    finally:
        engine.stop()
    assert prefills == 1 if wait_ms or last_step_s else prefills >= 2, prefills
