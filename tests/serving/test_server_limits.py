"""The server under hostile input (a real `tutel-jax serve` subprocess with small limits): deeply nested JSON,
bodies over --max-request-bytes, slow and truncated requests, unknown models, routes and methods. Each is
answered with an OpenAI-shaped 4xx and the server keeps serving, on the same keep-alive connection where HTTP
allows it. Also `usage` in every response and `stream_options.include_usage`."""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi", reason="needs the `serve` extra")

from support.server_process import served  # noqa: E402
from test_server import FIXTURE  # noqa: E402

MAX_BYTES = 256 * 1024  # above the 200 KB nested body
READ_TIMEOUT_S = 2.0
NAME = "tiny-moe"
GOOD = {"model": NAME, "prompt": [9, 8, 7], "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["--served-model-name", NAME, "--max-request-bytes", str(MAX_BYTES), "--read-timeout",
            str(READ_TIMEOUT_S), "--max-batch-size", "4"]
    # no tracebacks: every hostile request was handled, none crashed a handler
    with served(FIXTURE, args, tmp_path_factory.mktemp("limits"), no_tracebacks=True) as base:
        yield int(base.rsplit(":", 1)[1])


def _error(r: httpx.Response | http.client.HTTPResponse, data: bytes | None = None) -> dict:
    body = json.loads(data if data is not None else r.content)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"], body
    return body["error"]


def _read_response(s: socket.socket) -> tuple[str, dict]:
    """The status line and JSON body of one raw HTTP response on socket `s`."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk, "connection closed in the body"
        body += chunk
    return head.decode().split("\r\n")[0], json.loads(body)


def _good_on(conn: http.client.HTTPConnection) -> None:
    conn.request("POST", "/v1/completions", json.dumps(GOOD), {"content-type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    assert r.status == 200, data
    assert len(json.loads(data)["choices"][0]["token_ids"]) == 3


def test_deeply_nested_json_is_a_400_and_the_connection_stays_usable(server):
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=30)
    body = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    assert r.status == 400, data
    assert _error(r, data)["code"] == "invalid_json" and "nested" in _error(r, data)["message"]
    sock = conn.sock
    _good_on(conn)  # the same keep-alive connection
    assert conn.sock is sock
    # nesting below the parser's limit is a plain type error
    conn.request("POST", "/v1/completions", b'{"prompt": ' + b"[" * 500 + b"]" * 500 + b"}",
                 {"content-type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    assert r.status == 400 and _error(r, data)["param"] == "prompt", data
    conn.close()


def test_body_over_the_limit_is_refused_before_it_is_read(server):
    # Content-Length of 50 MB and no body sent: the answer comes at once, so nothing was waited for or read
    with socket.create_connection(("127.0.0.1", server), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 50000000\r\n\r\n")
        status, body = _read_response(s)
    assert status.startswith("HTTP/1.1 413"), status
    err = body["error"]
    assert err["code"] == "request_too_large" and str(MAX_BYTES) in err["message"]
    # a chunked body (no Content-Length) is cut off as soon as it passes the limit
    def chunks():
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"a" * 4096
    r = httpx.post(f"http://127.0.0.1:{server}/v1/completions", content=chunks(),
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and _error(r)["code"] == "request_too_large"
    # just under the limit is read and validated as usual
    r = httpx.post(f"http://127.0.0.1:{server}/v1/completions", timeout=30,
                   json={"prompt": [1] * 10_000, "model": NAME})
    assert r.status_code == 400 and _error(r)["code"] == "context_length_exceeded"


def test_prompts_times_n_are_bounded_before_tokenizing(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server}", timeout=30) as h:
        r = h.post("/v1/completions", json={"prompt": [[1, 2]] * 5})
        assert r.status_code == 400 and _error(r)["param"] == "prompt" and "max batch size 4" in _error(r)["message"]
        r = h.post("/v1/completions", json={"prompt": [[1, 2]] * 2, "n": 3})
        assert r.status_code == 400 and _error(r)["param"] == "n"
        # 10,000 text prompts: refused for their count, not tokenized one by one (the fixture has no tokenizer)
        r = h.post("/v1/completions", json={"prompt": ["x"] * 10_000})
        assert r.status_code == 400 and _error(r)["param"] == "prompt" and "batch size" in _error(r)["message"]


def test_slow_headers_and_slow_bodies_time_out_while_others_are_served(server):
    slow = socket.create_connection(("127.0.0.1", server), timeout=15)
    start = time.monotonic()
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\n")
    # another client is answered while the slow one trickles its headers
    with httpx.Client(base_url=f"http://127.0.0.1:{server}", timeout=30) as h:
        assert h.post("/v1/completions", json=GOOD).status_code == 200
    reply = b""
    try:
        for _ in range(40):
            slow.sendall(b"X")
            time.sleep(0.25)
            slow.settimeout(0.01)
            try:
                reply += slow.recv(4096)
            except socket.timeout:
                pass
            slow.settimeout(15)
            if reply:
                break
    except (BrokenPipeError, ConnectionResetError):
        pass
    elapsed = time.monotonic() - start
    slow.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert READ_TIMEOUT_S - 0.5 < elapsed < READ_TIMEOUT_S + 5, elapsed
    # headers complete, the body trickles
    with socket.create_connection(("127.0.0.1", server), timeout=15) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{")
        start = time.monotonic()
        s.settimeout(READ_TIMEOUT_S + 5)
        status, body = _read_response(s)
        elapsed = time.monotonic() - start
    assert status.startswith("HTTP/1.1 408"), status
    assert body["error"]["code"] == "request_timeout"
    assert elapsed < READ_TIMEOUT_S + 3, elapsed


def test_truncated_request_does_not_disturb_the_server(server):
    with socket.create_connection(("127.0.0.1", server), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"prompt\": [1, 2")
    with httpx.Client(base_url=f"http://127.0.0.1:{server}", timeout=30) as h:
        assert h.post("/v1/completions", json=GOOD).status_code == 200
        assert h.get("/health").json()["status"] == "ok"


def test_served_model_name_and_unknown_models(server):
    base = f"http://127.0.0.1:{server}"
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=30)
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt=[1, 2], max_tokens=2)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    r = httpx.post(base + "/v1/chat/completions", json={"model": "gpt-4", "messages": [{"role": "user",
                                                                                        "content": "hi"}]})
    assert r.status_code == 404 and _error(r)["code"] == "model_not_found"
    assert client.completions.create(model=NAME, prompt=[1, 2], max_tokens=2).model == NAME


def test_unknown_routes_and_wrong_methods_have_the_openai_error_shape(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server}", timeout=30) as h:
        r = h.get("/v1/nothing")
        assert r.status_code == 404 and _error(r)["type"] == "not_found_error"
        r = h.get("/v1/completions")
        assert r.status_code == 405 and _error(r)["code"] == "method_not_allowed"
        assert "POST" in r.headers.get("allow", "")
        r = h.put("/v1/chat/completions", json={})
        assert r.status_code == 405 and _error(r)["code"] == "method_not_allowed"


def test_usage_in_every_response_and_include_usage_when_streaming(server):
    base = f"http://127.0.0.1:{server}"
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=30)
    r = client.completions.create(model=NAME, prompt=[[1, 2, 3], [4, 5]], max_tokens=3, temperature=0, n=2)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 12, 17)
    chunks = list(client.completions.create(model=NAME, prompt=[1, 2, 3], max_tokens=3, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (3, 3)
    with httpx.stream("POST", base + "/v1/completions", json={**GOOD, "stream": True}) as s:
        events = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
    assert events and all("usage" not in e for e in events)  # not asked for
    r = httpx.post(base + "/v1/completions", json={**GOOD, "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and _error(r)["param"] == "stream_options"
    r = httpx.post(base + "/v1/completions", json={**GOOD, "stream": True, "stream_options": {"include_usage": 1}})
    assert r.status_code == 400 and _error(r)["param"] == "stream_options.include_usage"


def test_validation_errors_and_internal_errors_have_the_openai_shape(monkeypatch):
    """In process: a 422 from a typed route and an unexpected exception are answered in the OpenAI error shape,
    and the connection of an internal error is not reset (the guard answers it)."""
    from fastapi.testclient import TestClient

    from tutel_jax.models import from_pretrained
    from tutel_jax.serving import _app as app_module
    from tutel_jax.serving._server import ServerConfig, create_app

    app = create_app(FIXTURE, ServerConfig(), model=from_pretrained(FIXTURE), warmup=False)

    @app.get("/typed")
    async def typed(k: int):
        return {"k": k}

    def boom(body, limits):
        raise RuntimeError("boom")

    monkeypatch.setattr(app_module, "parse_completion", boom)
    with TestClient(app, raise_server_exceptions=False) as h:
        r = h.get("/typed", params={"k": "x"})
        assert r.status_code == 422 and _error(r)["param"] == "k"
        r = h.post("/v1/completions", json={"prompt": [1]})
        assert r.status_code == 500 and _error(r)["type"] == "server_error" and "boom" in _error(r)["message"]
        assert h.get("/health").status_code == 200
