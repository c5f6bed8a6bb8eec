"""The OpenAI-compatible server (tutel_jax.serving._server): a real server in a subprocess on the qwen3_moe fixture,
driven by the official `openai` client (and httpx for raw/bad requests). Greedy answers must equal offline
`generate`; concurrent clients are batched and all answered; bad requests get OpenAI-style 4xx errors."""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
import time

import numpy as np
import pytest
from support.paths import HF

openai = pytest.importorskip("openai", reason="needs the `openai` client (pip install -e .[test])")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="needs the `serve` extra")
pytest.importorskip("uvicorn", reason="needs the `serve` extra")

from support.server_process import served  # noqa: E402

FIXTURE = HF / "qwen3_moe"
MODEL = FIXTURE.name  # the served model id: the checkpoint directory's name by default
# the subprocess server's --batching (continuous by default; TUTEL_TEST_BATCHING=bucketed tests the other engine)
BATCHING = os.environ.get("TUTEL_TEST_BATCHING", "continuous")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with served(FIXTURE, ["--max-batch-size", "16", "--batch-wait-ms", "10", "--batching", BATCHING],
                tmp_path_factory.mktemp("server")) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0, timeout=60)


def _offline(model, prompts, n):
    """Greedy reference: one batched `generate` (each row equals that prompt run alone)."""
    from tutel_jax.serving import generate
    T = max(map(len, prompts))
    ids = np.zeros((len(prompts), T), np.int32)
    mask = np.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, :len(p)], mask[b, :len(p)] = p, 1
    return generate(model, ids, n, attention_mask=mask).tokens.tolist()


def test_health_and_models(server, client):
    assert httpx.get(server + "/health").json()["status"] == "ok"
    models = client.models.list()
    assert [m.id for m in models.data] == ["qwen3_moe"]


def test_greedy_matches_generate(client, model):
    prompt = [5, 17, 99, 3, 42]
    ref = _offline(model, [prompt], 8)[0]
    r = client.completions.create(model="qwen3_moe", prompt=prompt, max_tokens=8, temperature=0)
    c = r.choices[0]
    assert c.token_ids == ref and c.finish_reason == "length" and c.text == ""
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 8

    # streaming: one chunk per token (as it is produced), then a finish chunk, then [DONE] (the client stops on it)
    chunks = [c.choices[0] for c in client.completions.create(model="qwen3_moe", prompt=prompt, max_tokens=8,
                                                              temperature=0, stream=True)]
    assert [c.token_ids for c in chunks] == [[t] for t in ref] + [[]]
    assert [c.finish_reason for c in chunks] == [None] * 8 + ["length"]

    # stop token ids: cut before the first stop token; streamed, the stop token gets no chunk
    r = client.completions.create(model="qwen3_moe", prompt=prompt, max_tokens=8, temperature=0, stop=[ref[3]])
    cut = ref[:ref.index(ref[3])]
    assert r.choices[0].token_ids == cut and r.choices[0].finish_reason == "stop"
    chunks = [c.choices[0] for c in client.completions.create(model="qwen3_moe", prompt=prompt, max_tokens=8,
                                                              temperature=0, stop=[ref[3]], stream=True)]
    assert [c.token_ids for c in chunks] == [[t] for t in cut] + [[]] and chunks[-1].finish_reason == "stop"


def test_short_streamed_request_finishes_before_a_long_one_in_its_batch(server, client, model):
    """A short and a long streamed request batched together: the short one's last chunk and [DONE] come when
    it is done, while the long one is still generating."""
    short_p, long_p = [3, 1, 4], [5, 17, 99]
    ref_long, ref_short = _offline(model, [long_p, short_p], 100)
    ref_short = ref_short[:2]

    def ask(prompt, max_tokens, barrier):
        """(time of the end of the stream, tokens, arrival time of each token's chunk)."""
        barrier.wait()  # send both at once: the worker gathers them into one batch
        toks, arrivals = [], []
        for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True):
            toks += c.choices[0].token_ids
            arrivals += [time.monotonic()] * len(c.choices[0].token_ids)
        return time.monotonic(), toks, arrivals

    for _ in range(8):  # two requests sent together usually share a batch (not always on a loaded machine): retry
        before = httpx.get(server + "/health").json()["batches_run"]
        barrier = threading.Barrier(2)
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            long_f, short_f = ex.submit(ask, long_p, 100, barrier), ex.submit(ask, short_p, 2, barrier)
            (t_long, toks_long, arrivals), (t_short, toks_short, _) = long_f.result(), short_f.result()
        if httpx.get(server + "/health").json()["batches_run"] - before == 1:
            break
    else:
        pytest.fail("the two concurrent requests never shared a batch")
    assert toks_short == ref_short and toks_long == ref_long
    assert t_short < t_long
    # the long one was still streaming when the short one ended (not answered together at the batch's end)
    assert sum(a <= t_short for a in arrivals) < 100


def test_request_sent_while_another_runs_is_answered_first(client, model):
    """Continuous batching: a short request sent after a long streamed one has started joins the running batch
    and is answered while the long one is still streaming (a bucketed server would make it wait)."""
    if BATCHING != "continuous":
        pytest.skip("continuous batching only")
    long_p, short_p = [5, 17, 99], [8, 6, 7, 5]
    ref_long, ref_short = _offline(model, [long_p, short_p], 120)
    started, long_toks, short_done = threading.Event(), [], []

    def long_stream():
        for c in client.completions.create(model=MODEL, prompt=long_p, max_tokens=120, temperature=0, stream=True):
            long_toks.extend(c.choices[0].token_ids)
            started.set()

    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        f = ex.submit(long_stream)
        assert started.wait(60)
        r = client.completions.create(model=MODEL, prompt=short_p, max_tokens=3, temperature=0)
        short_done.append(len(long_toks))
        f.result()
    assert r.choices[0].token_ids == ref_short[:3]
    assert long_toks == ref_long
    assert short_done[0] < 120, "the short request was answered only after the long one had finished"


def test_seeded_sampling_does_not_depend_on_concurrent_traffic(client):
    kw = {"model": MODEL, "prompt": [4, 5, 6], "max_tokens": 8, "temperature": 0.8, "seed": 99, "n": 2}
    alone = [c.token_ids for c in client.completions.create(**kw).choices]
    rng = np.random.default_rng(1)
    others = [rng.integers(0, 128, size=int(rng.integers(1, 20))).tolist() for _ in range(8)]

    def busy(i):
        return client.completions.create(model=MODEL, prompt=others[i], max_tokens=12, temperature=[0, 1.0][i % 2])

    with concurrent.futures.ThreadPoolExecutor(9) as ex:
        futures = [ex.submit(busy, i) for i in range(8)]
        time.sleep(0.02)  # the seeded request arrives while the others run
        again = [c.token_ids for c in client.completions.create(**kw).choices]
        [f.result() for f in futures]
    assert again == alone and alone[0] != alone[1]


def test_multiple_prompts_n_and_seed(client, model):
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11, 12, 13], [100]]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2)
    ref = _offline(model, prompts, 6)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.token_ids for c in r.choices] == [t for t in ref for _ in range(2)]

    kw = dict(model=MODEL, prompt=[4, 5, 6], max_tokens=6, temperature=1.0, top_p=0.9, seed=1234, n=3)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.token_ids for c in a.choices] == [c.token_ids for c in b.choices]  # seeded: reproducible
    assert all(len(c.token_ids) == 6 and all(0 <= t < 128 for t in c.token_ids) for c in a.choices)
    assert len({tuple(c.token_ids) for c in a.choices}) > 1  # n samples differ


def test_concurrent_clients(server, client, model):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, size=int(rng.integers(1, 20))).tolist() for _ in range(32)]
    ref = _offline(model, prompts, 6)
    before = httpx.get(server + "/health").json()["batches_run"]

    def ask(i):
        return client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=6, temperature=0)

    with concurrent.futures.ThreadPoolExecutor(32) as ex:
        results = list(ex.map(ask, range(32)))
    assert [r.choices[0].token_ids for r in results] == ref
    batches = httpx.get(server + "/health").json()["batches_run"] - before
    assert batches < 32, f"{batches} generate calls for 32 concurrent requests: no batching"


BAD = [
    (b"{not json", "invalid_json", None),
    (b"[1, 2]", "invalid_json", None),
    ({"prompt": "hello"}, "tokenizer_unavailable", "prompt"),  # no tokenizer.json in the fixture
    ({"prompt": []}, "invalid_type", "prompt"),
    ({"prompt": [[]]}, "invalid_value", "prompt"),
    ({"prompt": [1, "a"]}, "invalid_type", "prompt"),
    ({"prompt": [1, 2], "max_tokens": -3}, "invalid_value", "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": 10 ** 9}, "invalid_value", "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": "5"}, "invalid_type", "max_tokens"),
    ({"prompt": [1, 2], "temperature": "hot"}, "invalid_type", "temperature"),
    ({"prompt": [1, 2], "n": 0}, "invalid_value", "n"),
    ({"prompt": [1, 2], "stop": "\n"}, "tokenizer_unavailable", "stop"),
    ({"prompt": [1, 2], "stream": "yes"}, "invalid_type", "stream"),
    ({"prompt": [1000]}, "invalid_value", "prompt"),  # outside the vocabulary
    ({"prompt": [1] * 200}, "context_length_exceeded", "prompt"),
    ({"prompt": [1] * 120, "max_tokens": 20}, "context_length_exceeded", "max_tokens"),
    ({}, "missing_required_parameter", "prompt"),
]


def test_bad_requests_get_4xx_and_server_keeps_serving(server, client, model):
    good = [9, 8, 7]
    ref = _offline(model, [good], 4)[0]
    with httpx.Client(base_url=server, timeout=60) as h:
        for body, code, param in BAD:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = h.post("/v1/completions", content=content, headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], err
            assert (err["code"], err["param"]) == (code, param), (body, err)
            # a good request right after each bad one is still answered
            ok = h.post("/v1/completions", json={"prompt": good, "max_tokens": 4, "temperature": 0})
            assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"] == ref
        r = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "tokenizer_unavailable"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=-1)


def test_queue_limit_answers_429():
    """A full queue is refused (unit level: the worker is not started, so nothing drains)."""
    from tutel_jax.serving._server import APIError, Engine, Job, QueueFull, ServerConfig
    eng = Engine(model=None, cfg=ServerConfig(max_queue=2))

    def job():
        return Job([[1]], 1, 1, 0.0, None, None, concurrent.futures.Future())

    queued = [job(), job()]
    for j in queued:
        eng.submit(j)
    with pytest.raises(QueueFull):
        eng.submit(job())
    eng.stop()  # queued jobs are failed with 503, not left hanging
    assert all(isinstance(j.future.exception(timeout=1), APIError) and j.future.exception().status == 503
               for j in queued)
    with pytest.raises(APIError):  # after stop: 503
        eng.submit(job())


def test_full_queue_is_answered_429_over_http(model):
    """The HTTP path of a full queue (in-process app; the worker is not started, so the queue stays full)."""
    from fastapi.testclient import TestClient

    from tutel_jax.serving._server import Job, ServerConfig, create_app
    app = create_app(FIXTURE, ServerConfig(max_queue=1), model=model, warmup=False)
    app.state.server.engine.submit(Job([[1]], 1, 1, 0.0, None, None, concurrent.futures.Future()))
    r = TestClient(app).post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    assert r.json()["error"]["type"] == "rate_limit_error"
    app.state.server.engine.stop()


def test_text_prompts_stop_strings_and_chat_with_a_tokenizer(tmp_path, model):
    """With a tokenizer.json (+ chat template) next to the checkpoint: text prompts, string stops, chat, streaming
    (in-process app on a copy of the fixture with a word-level tokenizer 't0'..'t127')."""
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from fastapi.testclient import TestClient

    from tutel_jax.serving._server import ServerConfig, create_app
    for f in ("config.json", "model.safetensors"):
        (tmp_path / f).symlink_to(FIXTURE / f)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}))
    ref = _offline(model, [[5, 17, 99]], 6)[0]
    ref_text = " ".join(f"t{t}" for t in ref)
    app = create_app(tmp_path, ServerConfig(), model=model, warmup=False)
    with TestClient(app) as h:
        r = h.post("/v1/completions", json={"prompt": "t5 t17 t99", "max_tokens": 6, "temperature": 0}).json()
        assert r["choices"][0]["token_ids"] == ref and r["choices"][0]["text"] == ref_text
        stop = f"t{ref[2]}"
        r = h.post("/v1/completions", json={"prompt": ["t5 t17 t99"], "max_tokens": 6, "temperature": 0,
                                            "stop": [stop]}).json()
        c = r["choices"][0]
        assert c["text"] == ref_text[:ref_text.index(stop)] and c["finish_reason"] == "stop"
        # streamed with the stop string: text that may become the stop string is held back, then cut
        chunks = _stream(h, "/v1/completions", {"prompt": ["t5 t17 t99"], "max_tokens": 6, "temperature": 0,
                                                "stop": [stop], "stream": True})
        assert "".join(ch["choices"][0]["text"] for ch in chunks) == c["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        # one chunk per token, each carrying that token's text
        chunks = _stream(h, "/v1/completions", {"prompt": "t5 t17 t99", "max_tokens": 6, "temperature": 0,
                                                "stream": True})
        assert [ch["choices"][0]["token_ids"] for ch in chunks] == [[t] for t in ref] + [[]]
        assert [ch["choices"][0]["text"] for ch in chunks] == [f"{' ' if k else ''}t{t}" for k, t in enumerate(ref)] \
            + [""]
        r = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "t5 t17"},
                                                              {"role": "user", "content": "t99"}],
                                                 "max_tokens": 6, "temperature": 0}).json()
        assert r["object"] == "chat.completion" and r["choices"][0]["message"] == {"role": "assistant",
                                                                                   "content": ref_text}
        chunks = _stream(h, "/v1/chat/completions", {"messages": [{"role": "user", "content": "t5 t17 t99"}],
                                                     "max_tokens": 6, "temperature": 0, "stream": True})
        assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert [ch["choices"][0]["token_ids"] for ch in chunks[1:]] == [[t] for t in ref] + [[]]
        assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks) == ref_text
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def _stream(h, url: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed response (checking that it ends with [DONE])."""
    with h.stream("POST", url, json=body) as s:
        lines = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def _byte_level_tokenizer():
    """A byte-level tokenizer for the fixture's 128 ids: ids 0-63 are UTF-8 continuation bytes, 64-93 lead bytes of
    two-byte characters, 94-127 ASCII letters; a lead token followed by a continuation token is one character."""
    import tokenizers
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + k) for k, b in enumerate(others)}  # byte-level alphabet

    def byte(i):
        return 0x80 + i if i < 64 else 0xC2 + i - 64 if i < 94 else 0x41 + i - 94

    tok = tokenizers.Tokenizer(tokenizers.models.BPE({char[byte(i)]: i for i in range(128)}, []))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    return tok, byte


def test_streamed_text_of_characters_split_over_tokens(tmp_path, model):
    """Streamed text deltas decode the whole sequence: a two-byte character split over two tokens arrives whole,
    and the deltas add up to the non-streamed text."""
    pytest.importorskip("tokenizers")
    from fastapi.testclient import TestClient

    from tutel_jax.serving._server import ServerConfig, create_app
    for f in ("config.json", "model.safetensors"):
        (tmp_path / f).symlink_to(FIXTURE / f)
    tok, byte = _byte_level_tokenizer()
    tok.save(str(tmp_path / "tokenizer.json"))
    prompt = [5, 17, 99]
    ref = _offline(model, [prompt], 8)[0]
    pairs = [k for k in range(7) if 0xC2 <= byte(ref[k]) < 0xE0 and byte(ref[k + 1]) < 0xC0]
    assert pairs, f"the reference {ref} has no lead+continuation pair: pick another prompt"
    full = tok.decode(ref)
    with TestClient(create_app(tmp_path, ServerConfig(), model=model, warmup=False)) as h:
        r = h.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0}).json()
        assert r["choices"][0]["text"] == full
        chunks = _stream(h, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                "stream": True})
    assert [ch["choices"][0]["token_ids"] for ch in chunks] == [[t] for t in ref] + [[]]
    texts = [ch["choices"][0]["text"] for ch in chunks]
    assert "".join(texts) == full
    k = pairs[0]  # the character completed by token k + 1 arrives whole with it
    assert bytes([byte(ref[k]), byte(ref[k + 1])]).decode() in texts[k + 1]
