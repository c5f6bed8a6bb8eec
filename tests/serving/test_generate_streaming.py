"""`generate` token by token: stream_callback, stop tokens, per-row limits and early stopping (qwen3_moe fixture).

Early stops must not change any token: every result here is compared with the plain run of the same arguments."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from tutel_jax.serving import generate
from support.paths import HF

FIXTURE = HF / "qwen3_moe"
N = 8
gen_module = importlib.import_module("tutel_jax.serving._generate")  # the module (the package exports the function)


@pytest.fixture(scope="module")
def greedy(model, prompts):
    """The plain greedy run: all N steps, no callback, no stops."""
    return generate(model, prompts, N).tokens


@pytest.fixture
def decode_calls(monkeypatch):
    """Counts the decode-step dispatches of the host loop (the prefill is step 0)."""
    calls = []
    real = gen_module.decode_step

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(gen_module, "decode_step", counting)
    return calls


def _stopped(tokens: np.ndarray, stops, pad: int = 0) -> np.ndarray:
    """Reference masking: positions after a row's first stop token become pad."""
    out = tokens.copy()
    for row in out:
        hits = np.flatnonzero(np.isin(row, stops))
        if len(hits):
            row[hits[0] + 1:] = pad
    return out


def test_callback_sees_each_step_in_order(model, prompts, greedy, decode_calls):
    seen = []
    out = generate(model, prompts, N, stream_callback=lambda step, toks: seen.append((step, toks)))
    assert [s for s, _ in seen] == list(range(N)) and len(decode_calls) == N - 1
    assert all(t.dtype == np.int32 and t.shape == (2,) for _, t in seen)
    np.testing.assert_array_equal(np.stack([t for _, t in seen], axis=1), out.tokens)
    np.testing.assert_array_equal(out.tokens, greedy)
    assert out.completion_lengths.tolist() == [N, N]


def test_several_stop_tokens_stop_early(model, prompts, greedy, decode_calls):
    # one stop token from each row: the loop ends when the later of the two rows has finished
    stops = [int(greedy[0, 1]), int(greedy[1, 3])]
    expected = _stopped(greedy, stops)
    last = max(np.flatnonzero(np.isin(greedy[b], stops))[0] for b in range(2))
    seen = []
    out = generate(model, prompts, N, stop_token_ids=stops, stream_callback=lambda s, t: seen.append(t))
    np.testing.assert_array_equal(out.tokens, expected)
    np.testing.assert_array_equal(np.stack(seen, axis=1), expected[:, :len(seen)])
    assert len(seen) == last + 1 and len(decode_calls) == last < N - 1  # fewer decode steps
    assert out.tokens.shape == (2, N) and out.sequences.shape == (2, prompts.shape[1] + N)
    assert out.completion_lengths.tolist() == [int(np.flatnonzero(np.isin(greedy[b], stops))[0]) + 1
                                               for b in range(2)]
    # without a callback: the same tokens; an int, and eos_token_id as its alias, stop alike
    np.testing.assert_array_equal(generate(model, prompts, N, stop_token_ids=stops).tokens, expected)
    one = generate(model, prompts, N, stop_token_ids=stops[0]).tokens
    np.testing.assert_array_equal(one, generate(model, prompts, N, eos_token_id=stops[0]).tokens)
    np.testing.assert_array_equal(one, _stopped(greedy, stops[:1]))


def test_callback_requests_early_stop_of_seeded_sampling(model, prompts, decode_calls):
    kw = {"temperature": 2.0, "top_p": 0.9, "seed": 1}
    full = generate(model, prompts, N, **kw)
    decode_calls.clear()
    out = generate(model, prompts, N, stream_callback=lambda step, toks: step == 3, return_logits=True, **kw)
    assert len(decode_calls) == 3
    np.testing.assert_array_equal(out.tokens[:, :4], full.tokens[:, :4])
    assert (out.tokens[:, 4:] == 0).all() and out.completion_lengths.tolist() == [4, 4]
    assert np.isfinite(out.logits[:, :4]).all() and np.isnan(out.logits[:, 4:]).all()
    # only an actual True stops: a callback returning other values runs every step
    decode_calls.clear()
    again = generate(model, prompts, N, stream_callback=lambda step, toks: [step], **kw)
    assert len(decode_calls) == N - 1
    np.testing.assert_array_equal(again.tokens, full.tokens)


def test_per_row_limits(model, prompts, greedy, decode_calls):
    out = generate(model, prompts, N, max_new_tokens_per_row=[3, 5])
    assert len(decode_calls) == 4  # steps 0..4: row 1's limit
    np.testing.assert_array_equal(out.tokens[0], np.r_[greedy[0, :3], [0] * 5])
    np.testing.assert_array_equal(out.tokens[1], np.r_[greedy[1, :5], [0] * 3])
    assert out.completion_lengths.tolist() == [3, 5]


def test_on_device_applies_stops_and_rejects_a_callback(model, prompts, greedy):
    stops = [int(greedy[0, 1]), int(greedy[1, 3])]
    out = generate(model, prompts, N, stop_token_ids=stops, on_device=True)
    np.testing.assert_array_equal(out.tokens, _stopped(greedy, stops))
    with pytest.raises(ValueError, match="stream_callback"):
        generate(model, prompts, N, on_device=True, stream_callback=lambda s, t: None)
    with pytest.raises(ValueError, match="max_new_tokens_per_row"):
        generate(model, prompts, N, max_new_tokens_per_row=[0, 3])
