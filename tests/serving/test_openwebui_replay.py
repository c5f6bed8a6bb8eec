"""Open-WebUI compatibility without Open-WebUI: the requests it sent to the server in a real session
(tests/fixtures/openwebui_requests.json, recorded by benchmarks/openwebui_demo/run_demo.sh through its recording
proxy) are replayed in order against a real server in a subprocess on the chat checkpoint
(tests/fixtures/make_chat_checkpoint.py: the qwen3_moe fixture plus a tokenizer and a ChatML template). Each must
get a 200 and the OpenAI response shape Open-WebUI reads: the model list naming the served model, streamed chat
as `chat.completion.chunk` server-sent events ending with `data: [DONE]`, non-streamed chat with a message and
usage."""

from __future__ import annotations

import json
import sys

import pytest
from support.paths import FIXTURES

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="needs the `serve` extra")
pytest.importorskip("uvicorn", reason="needs the `serve` extra")
pytest.importorskip("tokenizers", reason="needs the `serve` extra")
pytest.importorskip("jinja2", reason="needs the `serve` extra")


sys.path.insert(0, str(FIXTURES))
from make_chat_checkpoint import make_chat_checkpoint  # noqa: E402
from support.server_process import served  # noqa: E402

RECORDING = json.loads((FIXTURES / "openwebui_requests.json").read_text())
REQUESTS = RECORDING["requests"]
# the model id Open-WebUI asked for: the server must serve that name
MODEL = next(r["body"]["model"] for r in REQUESTS if isinstance(r["body"], dict) and "model" in r["body"])
# Open-WebUI's title generation asks for max_tokens 1000: above the server's default cap of 512
MAX_TOKENS = max([1024] + [r["body"].get("max_tokens") or 0 for r in REQUESTS if isinstance(r["body"], dict)])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = make_chat_checkpoint(tmp_path_factory.mktemp("chat_ckpt"))
    with served(ckpt, ["--served-model-name", MODEL, "--max-tokens", str(MAX_TOKENS)],
                tmp_path_factory.mktemp("server"), no_tracebacks=True) as base:
        yield base


def test_recording_is_what_open_webui_sends():
    """The fixture holds the calls of one Open-WebUI chat: the model listing, a streamed chat completion, and its
    non-streamed task completions (title, follow-ups, tags); only content-type / accept headers are kept."""
    assert "Open-WebUI" in RECORDING["source"]
    kinds = [(r["method"], r["path"], (r["body"] or {}).get("stream", False)) for r in REQUESTS]
    assert ("GET", "/v1/models", False) in kinds
    assert kinds.count(("POST", "/v1/chat/completions", True)) == 1
    assert kinds.count(("POST", "/v1/chat/completions", False)) >= 3
    for r in REQUESTS:
        assert set(r["headers"]) <= {"content-type", "accept"}
        assert r["recorded_status"] == 200


def _sse_chunks(response) -> list[dict]:
    """The JSON events of a streamed chat completion (which must end with [DONE] and contain nothing else)."""
    assert response.headers["content-type"].startswith("text/event-stream")
    data = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


def _check_chat_completion(body: dict):
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert isinstance(body["id"], str) and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0 and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def _check_stream(chunks: list[dict]) -> str:
    assert chunks and all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    finished = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finished[-1] in ("stop", "length") and not any(finished[:-1])
    return text


def test_replay_open_webui_requests(server):
    """Every recorded request, in order, with its method, path, query and body, gets a 200 and the shape
    Open-WebUI parses."""
    seen = []
    with httpx.Client(base_url=server, timeout=120) as client:
        for r in REQUESTS:
            kw = {"params": r["query"] or None, "headers": r["headers"]}
            if r["body"] is not None:
                kw["content"] = json.dumps(r["body"])
            stream = isinstance(r["body"], dict) and r["body"].get("stream") is True
            with client.stream(r["method"], r["path"], **kw) as resp:
                if resp.status_code != 200:
                    resp.read()
                    pytest.fail(f"{r['method']} {r['path']} -> {resp.status_code}: {resp.text[:1000]}")
                if stream:
                    text = _check_stream(_sse_chunks(resp))
                    seen.append(("stream", text))
                    continue
                resp.read()
            body = resp.json()
            if r["path"] == "/v1/models":
                assert body["object"] == "list"
                assert MODEL in [m["id"] for m in body["data"]]
                assert all(m["object"] == "model" for m in body["data"])
                seen.append(("models", None))
            else:
                _check_chat_completion(body)
                seen.append(("chat", body["choices"][0]["message"]["content"]))
    assert [k for k, _ in seen].count("stream") == 1 and ("models", None) in seen
