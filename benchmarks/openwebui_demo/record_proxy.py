"""A recording reverse proxy for an OpenAI-compatible server: forwards every request unchanged (responses are
streamed through as they arrive, so server-sent events stay live) and appends one JSON line per request to a log.

    python benchmarks/openwebui_demo/record_proxy.py serve --upstream http://127.0.0.1:8000 --port 8001 \
        --log /tmp/owui-demo/requests.jsonl
    python benchmarks/openwebui_demo/record_proxy.py reduce /tmp/owui-demo/requests.jsonl OUT.json --source "..."

Point a client (Open-WebUI: OPENAI_API_BASE_URL=http://127.0.0.1:8001/v1) at the proxy. Each log line has the
request's method, path, query, the headers that matter for compatibility (content-type, accept; never
authorization or cookies), its JSON body, and the response's status, content-type and (for non-streamed
responses) body. `reduce` (`reduce_log`) turns such a log into the fixture tests/fixtures/openwebui_requests.json.

Needs starlette, uvicorn and httpx (the project's `serve` and `test` extras have them).
"""

from __future__ import annotations

import argparse
import datetime
import json
import threading
from pathlib import Path

KEPT_HEADERS = ("content-type", "accept")
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authorization",
               "proxy-authenticate", "host", "content-length", "content-encoding"}


def create_app(upstream: str, log_path: Path):
    import httpx
    from starlette.applications import Starlette
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    client = httpx.AsyncClient(base_url=upstream.rstrip("/"), timeout=httpx.Timeout(600, connect=10))
    lock = threading.Lock()
    log_path.parent.mkdir(parents=True, exist_ok=True)

    def write(entry: dict):
        with lock, open(log_path, "a") as f:
            f.write(json.dumps(entry) + "\n")

    async def proxy(request):
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        entry = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
                 "method": request.method, "path": request.url.path, "query": request.url.query,
                 "headers": {k: request.headers[k] for k in KEPT_HEADERS if k in request.headers},
                 "user_agent": request.headers.get("user-agent"), "body": body}
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        headers["accept-encoding"] = "identity"  # the body is logged and streamed as sent
        req = client.build_request(request.method, request.url.path, params=request.url.query, headers=headers,
                                   content=raw)
        resp = await client.send(req, stream=True)
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
        entry["response"] = {"status": resp.status_code, "content_type": resp.headers.get("content-type")}
        if "text/event-stream" in (resp.headers.get("content-type") or ""):
            async def events():
                chunks = []
                try:
                    async for chunk in resp.aiter_raw():
                        chunks.append(chunk)
                        yield chunk
                finally:
                    await resp.aclose()
                    text = b"".join(chunks).decode(errors="replace")
                    entry["response"]["events"] = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
                    write(entry)
            return StreamingResponse(events(), status_code=resp.status_code, headers=out_headers)
        content = await resp.aread()
        await resp.aclose()
        try:
            entry["response"]["body"] = json.loads(content)
        except ValueError:
            entry["response"]["body"] = content.decode(errors="replace")
        write(entry)
        return Response(content, status_code=resp.status_code, headers=out_headers)

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
    return Starlette(routes=[Route("/{path:path}", proxy, methods=methods)])


def reduce_log(log_path: Path, source: str) -> dict:
    """The replayable fixture of a proxy log: per request method, path, query, kept headers and body, in the
    order they were sent (a log line is written when its response ends), and the recorded status (the responses
    are left out: the replay test checks the live server's answers), plus a `source` note."""
    requests = []
    entries = [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.strip()]
    for e in sorted(entries, key=lambda e: e["time"]):
        requests.append({"method": e["method"], "path": e["path"], "query": e["query"], "headers": e["headers"],
                         "body": e["body"], "recorded_status": e["response"]["status"]})
    return {"source": source, "requests": requests}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the proxy")
    s.add_argument("--upstream", required=True, help="the server to forward to, e.g. http://127.0.0.1:8000")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8001)
    s.add_argument("--log", type=Path, required=True, help="JSON-lines file the requests are appended to")
    r = sub.add_parser("reduce", help="turn a proxy log into the replay fixture")
    r.add_argument("log", type=Path)
    r.add_argument("out", type=Path)
    r.add_argument("--source", required=True, help="the fixture's note on where the requests come from")
    a = p.parse_args(argv)
    if a.cmd == "reduce":
        a.out.write_text(json.dumps(reduce_log(a.log, a.source), indent=1, ensure_ascii=False) + "\n")
        return
    import uvicorn
    uvicorn.run(create_app(a.upstream, a.log), host=a.host, port=a.port, log_level="info")


if __name__ == "__main__":
    main()
