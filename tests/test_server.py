"""The OpenAI-compatible server (tutel_jax.serving.server): a real server in a subprocess on the qwen3_moe fixture,
driven by the official `openai` client (and httpx for raw/bad requests). Greedy answers must equal offline
`generate`; concurrent clients are batched and all answered; bad requests get OpenAI-style 4xx errors."""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="needs the `openai` client (pip install -e .[test])")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="needs the `serve` extra")
pytest.importorskip("uvicorn", reason="needs the `serve` extra")

FIXTURE = Path(__file__).parent / "fixtures" / "hf" / "qwen3_moe"
REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    log_file = open(log_path, "w")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.Popen([sys.executable, "-m", "tutel_jax.serving.server", str(FIXTURE), "--host", "127.0.0.1",
                             "--port", str(port), "--max_batch_size", "16", "--batch_wait_ms", "10",
                             "--log_level", "info"],
                            cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("server did not become healthy within 90 s")
            time.sleep(0.25)
        yield base
    finally:
        proc.terminate()  # SIGTERM: uvicorn's graceful shutdown, then the worker stops
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
        log_file.close()
        text = log_path.read_text()
        # uvicorn re-raises the captured SIGTERM after its graceful shutdown: rc -15 (or 0)
        assert rc in (0, -15), (rc, text[-2000:])
        assert "Application shutdown complete" in text and "worker stopped" in text, text[-2000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model():
    from tutel_jax.models import from_pretrained
    return from_pretrained(FIXTURE)


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

    # streaming: one chunk per token, then a finish chunk, then [DONE] (the client stops on it)
    toks, reasons = [], []
    for chunk in client.completions.create(model="qwen3_moe", prompt=prompt, max_tokens=8, temperature=0,
                                           stream=True):
        ch = chunk.choices[0]
        toks += ch.token_ids
        reasons.append(ch.finish_reason)
    assert toks == ref and reasons[-1] == "length" and reasons[:-1] == [None] * 8

    # stop token ids: cut before the first stop token
    r = client.completions.create(model="qwen3_moe", prompt=prompt, max_tokens=8, temperature=0, stop=[ref[3]])
    cut = ref[:ref.index(ref[3])]
    assert r.choices[0].token_ids == cut and r.choices[0].finish_reason == "stop"


def test_multiple_prompts_n_and_seed(client, model):
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11, 12, 13], [100]]
    r = client.completions.create(model="m", prompt=prompts, max_tokens=6, temperature=0, n=2)
    ref = _offline(model, prompts, 6)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.token_ids for c in r.choices] == [t for t in ref for _ in range(2)]

    kw = dict(model="m", prompt=[4, 5, 6], max_tokens=6, temperature=1.0, top_p=0.9, seed=1234, n=3)
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
        return client.completions.create(model="m", prompt=prompts[i], max_tokens=6, temperature=0)

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
        client.completions.create(model="m", prompt=[1, 2], max_tokens=-1)


def test_queue_limit_answers_429():
    """A full queue is refused (unit level: the worker is not started, so nothing drains)."""
    from tutel_jax.serving.server import APIError, Engine, Job, QueueFull, ServerConfig
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

    from tutel_jax.serving.server import Job, ServerConfig, create_app
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

    from tutel_jax.serving.server import ServerConfig, create_app
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
        with h.stream("POST", "/v1/completions", json={"prompt": "t5 t17 t99", "max_tokens": 6, "temperature": 0,
                                                       "stream": True}) as s:
            lines = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        assert "".join(json.loads(x)["choices"][0]["text"] for x in lines[:-1]) == ref_text
        r = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "t5 t17"},
                                                              {"role": "user", "content": "t99"}],
                                                 "max_tokens": 6, "temperature": 0}).json()
        assert r["object"] == "chat.completion" and r["choices"][0]["message"] == {"role": "assistant",
                                                                                   "content": ref_text}
        with h.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "t5 t17 t99"}],
                                                            "max_tokens": 6, "temperature": 0, "stream": True}) as s:
            chunks = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
        assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
        assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks) == ref_text
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
