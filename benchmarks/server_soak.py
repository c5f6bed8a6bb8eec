"""Hostile-input soak of the OpenAI-compatible server: good clients keep being answered, with their p50/p99
latency, while other clients send what a server on a network meets.

    python benchmarks/server_soak.py [--checkpoint DIR] [--clients 64] [--duration 30] [--quick]
        [--out benchmarks/results/server_soak_cpu.json]

Protocol: one server subprocess (`--max-request-bytes 1 MiB --read-timeout 5`). Phase "calm": --clients good
clients (greedy /v1/completions on token-id prompts, every fourth one streamed, keep-alive connections) for
--duration seconds. Phase "hostile": the same good clients, and at the same time hostile clients in a loop, one
of each kind at a time:
  nested      a 200 KB body of 100,000 nested `[` (expect 400 invalid_json, the connection kept)
  huge        a 50 MB body, sent (expect 413 once 1 MiB is read; the rest is never read, and the connection is
              closed: a client still sending may see a reset instead of the 413)
  huge_header Content-Length 50 MB with no body (expect 413 at once)
  truncated   half a body, then the connection is closed (no answer expected)
  slow_loris  headers trickled one byte every 0.5 s (expect 408 after the read timeout), 16 at a time
  bad_json, unknown_model, wrong_method, bad_params (expect 400 / 404 / 405 / 400)
The run fails when a good request gets anything but 200 with the right number of tokens, a hostile request gets
an unexpected answer, or /health is not ok at the end. Results: benchmarks/results/server_soak_<backend>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `tutel_jax` and `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine_info, markdown_table, repo_root, write_json, write_text  # noqa: E402
from benchmarks.serve import _quantile, start_server  # noqa: E402

MAX_REQUEST_BYTES = 1 << 20
READ_TIMEOUT_S = 5.0
MAX_TOKENS = 8


async def _raw(port: int, data: bytes, read: bool = True, timeout: float = 30.0) -> int | None:
    """Sends raw bytes on a new connection; the response's status code (None when the server answers nothing)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        if not read:
            return None
        line = await asyncio.wait_for(reader.readline(), timeout)
        return int(line.split()[1]) if line else None
    except (ConnectionResetError, BrokenPipeError):
        return None
    finally:
        writer.close()


def _request(body: bytes, path: str = "/v1/completions", method: str = "POST", length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {n}\r\n\r\n"
            .encode() + body)


async def _huge(port: int) -> int | None:
    """50 MB sent in 64 KiB writes until the server answers (413) or closes. None: the connection was reset
    before the answer could be read (the server closes a connection whose body it will not read; the kernel
    then resets it while the client is still sending, which can discard the 413 already received)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    size = 50_000_000
    answer = asyncio.ensure_future(reader.readline())
    try:
        writer.write(_request(b"", length=size))
        chunk = b'{"prompt": "' + b"a" * (65536 - 12)
        for _ in range(size // len(chunk)):
            if answer.done():
                break
            writer.write(chunk)
            await writer.drain()
        await asyncio.wait_for(asyncio.shield(answer), 30)
    except (ConnectionResetError, BrokenPipeError):
        pass
    finally:
        writer.close()
    if answer.done() and not answer.cancelled() and answer.exception() is None and answer.result():
        return int(answer.result().split()[1])
    if answer.done() and not answer.cancelled():
        answer.exception()  # retrieved: no "never retrieved" warning
    answer.cancel()
    return None


async def _slow_loris(port: int) -> int | None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        answer = asyncio.ensure_future(reader.readline())
        for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000:
            if answer.done():
                break
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.5)
        line = await asyncio.wait_for(answer, READ_TIMEOUT_S + 10)
        return int(line.split()[1]) if line else None
    except (ConnectionResetError, BrokenPipeError):
        return None
    finally:
        writer.close()


NESTED = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
HOSTILE = {  # kind: (coroutine factory, expected statuses)
    "nested": (lambda port: _raw(port, _request(NESTED)), {400}),
    "huge": (_huge, {413, None}),  # None: see _huge
    "huge_header": (lambda port: _raw(port, _request(b"", length=50_000_000)), {413}),
    "truncated": (lambda port: _raw(port, _request(b'{"prompt": [1, 2', length=1000), read=False), {None}),
    "bad_json": (lambda port: _raw(port, _request(b"{not json")), {400}),
    "unknown_model": (lambda port: _raw(port, _request(b'{"model": "gpt-4", "prompt": [1]}')), {404}),
    "wrong_method": (lambda port: _raw(port, _request(b"", method="GET")), {405}),
    "bad_params": (lambda port: _raw(port, _request(b'{"prompt": [1], "temperature": -1}')), {400}),
}
SLOW_LORIS_AT_ONCE = 16


async def _good_client(client, idx: int, stop: float, latencies: list, failures: list) -> None:
    k = 0
    while time.monotonic() < stop:
        body = {"prompt": [1 + (idx + k) % 100, 2, 3], "max_tokens": MAX_TOKENS, "temperature": 0}
        stream = (idx + k) % 4 == 0
        t0 = time.perf_counter()
        try:
            if stream:
                async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    tokens = [json.loads(ln[6:])["choices"][0]["token_ids"] async for ln in r.aiter_lines()
                              if ln.startswith("data: {")]
                    ok = r.status_code == 200 and sum(map(len, tokens)) == MAX_TOKENS
            else:
                r = await client.post("/v1/completions", json=body)
                ok = r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == MAX_TOKENS
        except Exception as e:  # noqa: BLE001 - a failure to count, not to stop on
            ok, r = False, e
        if ok:
            latencies.append(time.perf_counter() - t0)
        else:
            failures.append(repr(r)[:200])
        k += 1


async def _hostile_loop(port: int, stop: float, outcomes: dict, unexpected: list) -> None:
    async def one(kind: str) -> None:
        factory, expected = HOSTILE[kind]
        try:
            status = await factory(port)
        except (OSError, asyncio.TimeoutError) as e:
            status = repr(e)
        outcomes.setdefault(kind, {}).setdefault(str(status), 0)
        outcomes[kind][str(status)] += 1
        if status not in expected:
            unexpected.append((kind, status))

    async def loris_checked() -> None:  # the statuses of slow-loris clients, counted like the others
        while time.monotonic() < stop:
            statuses = await asyncio.gather(*[_slow_loris(port) for _ in range(SLOW_LORIS_AT_ONCE)])
            for s in statuses:
                outcomes.setdefault("slow_loris", {}).setdefault(str(s), 0)
                outcomes["slow_loris"][str(s)] += 1
                if s != 408:
                    unexpected.append(("slow_loris", s))

    async def others() -> None:
        while time.monotonic() < stop:
            for kind in HOSTILE:
                await one(kind)

    await asyncio.gather(loris_checked(), others())


async def _phase(base: str, port: int, clients: int, duration: float, hostile: bool) -> dict:
    import httpx
    stop = time.monotonic() + duration
    latencies: list[float] = []
    failures: list[str] = []
    outcomes: dict = {}
    unexpected: list = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        t0 = time.perf_counter()
        tasks = [_good_client(client, i, stop, latencies, failures) for i in range(clients)]
        if hostile:
            tasks.append(_hostile_loop(port, stop, outcomes, unexpected))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        health = (await client.get("/health")).json()
    return {"good_requests": len(latencies), "good_failures": len(failures), "failure_examples": failures[:5],
            "p50_ms": 1e3 * statistics.median(latencies) if latencies else None,
            "p99_ms": 1e3 * _quantile(latencies, 0.99) if latencies else None,
            "max_ms": 1e3 * max(latencies) if latencies else None,
            "req_per_s": len(latencies) / wall, "hostile": outcomes, "unexpected": [list(map(str, u)) for u in
                                                                                    unexpected[:20]],
            "unexpected_count": len(unexpected), "health_after": health.get("status")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=str(repo_root() / "tests" / "fixtures" / "hf" / "qwen3_moe"))
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=30.0, help="seconds per phase")
    p.add_argument("--quick", action="store_true", help="8 clients, 4 s per phase (a smoke run)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.clients, a.duration = 8, 4.0
    info = machine_info()
    out = Path(a.out or repo_root() / "benchmarks" / "results" / f"server_soak_{info['backend']}.json")
    with tempfile.TemporaryFile("w+") as log_file:
        # the power-of-two decode row buckets that the good clients can fill (hostile requests never reach the model)
        warm = tuple(b for b in (1, 2, 4, 8, 16) if b < 2 * a.clients)
        proc, base = start_server(a.checkpoint, 16, 5.0, log_file, warm_batches=warm,
                                  warm_lens=(3,), max_tokens=MAX_TOKENS,
                                  extra_args=("--max-request-bytes", str(MAX_REQUEST_BYTES), "--read-timeout",
                                              str(READ_TIMEOUT_S), "--max-queue", "4096"))
        port = int(base.rsplit(":", 1)[1])
        try:
            phases = {name: asyncio.run(_phase(base, port, a.clients, a.duration, hostile))
                      for name, hostile in (("calm", False), ("hostile", True))}
            alive = proc.poll() is None
        finally:
            proc.terminate()
            proc.wait(30)
            log_file.seek(0)
            tracebacks = log_file.read().count("Traceback")
    result = {"machine": info, "clients": a.clients, "duration_s": a.duration, "max_tokens": MAX_TOKENS,
              "max_request_bytes": MAX_REQUEST_BYTES, "read_timeout_s": READ_TIMEOUT_S, "phases": phases,
              "server_alive": alive, "server_tracebacks": tracebacks}
    ok = (alive and tracebacks == 0 and all(ph["good_failures"] == 0 and ph["unexpected_count"] == 0
                                            and ph["health_after"] == "ok" for ph in phases.values()))
    result["passed"] = ok
    write_json(out, result)
    rows = [[name, ph["good_requests"], ph["good_failures"], f"{ph['req_per_s']:.1f}", f"{ph['p50_ms']:.0f}",
             f"{ph['p99_ms']:.0f}", sum(sum(v.values()) for v in ph["hostile"].values()), ph["unexpected_count"]]
            for name, ph in phases.items()]
    hostile = phases["hostile"]["hostile"]
    kinds = [[kind, ", ".join(f"{s}: {n}" for s, n in sorted(v.items()))] for kind, v in hostile.items()]
    md = (f"# Server soak ({info['backend']}, {a.clients} good clients, {a.duration:g} s per phase)\n\n"
          + markdown_table(["phase", "good requests", "failed", "req/s", "p50 ms", "p99 ms", "hostile requests",
                            "unexpected answers"], rows, "lrrrrrrr")
          + "\n\nHostile requests by kind (status: count; None: no answer, as expected for a truncated body, "
            "and for a huge body when the connection reset beat the 413 to the client):\n\n"
          + markdown_table(["kind", "answers"], kinds, "ll")
          + f"\n\nServer alive after the run: {alive}; tracebacks in its log: {tracebacks}; passed: {ok}.\n")
    write_text(out.with_suffix(".md"), md)
    print(md)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
