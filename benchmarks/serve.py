"""Serving benchmark: throughput and p50/p99 request latency of the OpenAI-compatible server at several
client concurrencies (default 1, 8, 32) against a checkpoint (default: the qwen3_moe test fixture, on CPU).

    python benchmarks/serve.py [--checkpoint DIR] [--concurrency 1 8 32] [--max_tokens 16] [--quick]
        [--batching continuous bucketed] [--out benchmarks/results/serve_cpu.json]

Protocol: the server runs in a subprocess (`python -m tutel_jax.serving`); for each concurrency c, c
client threads each send requests back to back (greedy, token-id prompts of random length in
[--min_prompt, --max_prompt], max_tokens fixed) over keep-alive connections. The server compiles every batch
shape the run can reach at startup (--warmup_batch_sizes / --warmup_prompt_lens); one untimed round per level,
then `--requests` requests (at least 4 per client) are timed. Each --batching mode (the server's continuous or
bucketed batching, optionally followed by more server flags, e.g. "continuous --no-row_buckets") gets its own
server, one after the other.
Latency: wall time of one request as its client sees it (queueing + batching + generation + HTTP).
Throughput: completion tokens (and requests) per second of the timed phase's wall time.
Results: benchmarks/results/serve_<backend>.{json,md}.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `tutel_jax` and `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks.common import machine_info, markdown_table, repo_root, write_json, write_text  # noqa: E402
from tutel_jax.parallel import free_port  # noqa: E402



def _quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(np.ceil(q * len(xs))) - 1))]


def start_server(checkpoint: str, max_batch_size: int, batch_wait_ms: float, log_file, warm_batches=(1,),
                 warm_lens=(1,), max_tokens: int = 2, batching: str = "continuous", extra_args=(),
                 healthy_within_s: float = 180):
    """(server process, base URL) of a server started with `--batching` + the words of `batching` (and
    `extra_args`), once /health answers (within `healthy_within_s`: loading and warmup compiles). Its compile
    cache is off: every run's startup compiles, as the first run on a machine does."""
    port = free_port()
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.Popen([sys.executable, "-m", "tutel_jax.serving", checkpoint, "--port", str(port),
                             "--max_batch_size", str(max_batch_size), "--batch_wait_ms", str(batch_wait_ms),
                             "--max_queue", "1024", "--log_level", "warning", "--batching", *batching.split(),
                             "--warmup_batch_sizes", *map(str, warm_batches), "--warmup_prompt_lens",
                             *map(str, warm_lens), "--warmup_max_tokens", str(max_tokens), "--compile-cache", "off",
                             *extra_args],
                            cwd=repo_root(), env=env, stdout=log_file, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, healthy_within_s)
    except RuntimeError:
        proc.kill()
        raise
    return proc, base


def wait_healthy(proc: subprocess.Popen, base: str, within_s: float) -> None:
    """Returns once GET base/health answers 200; RuntimeError when the process exits first or `within_s` seconds
    pass (any OpenAI-style server: tutel-jax's, llama.cpp's)."""
    import httpx
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"server did not become healthy within {within_s:.0f} s")


def stop_server(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM, then SIGKILL after `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


def run_level(base: str, c: int, n_requests: int, prompts, max_tokens: int):
    """(latencies [s], wall [s], completion tokens) of n_requests spread over c client threads."""
    import httpx
    per_client = [list(range(i, n_requests, c)) for i in range(c)]

    def client(idx):
        lat, toks = [], 0
        with httpx.Client(base_url=base, timeout=300) as h:
            for i in idx:
                t0 = time.perf_counter()
                r = h.post("/v1/completions", json={"prompt": prompts[i % len(prompts)], "max_tokens": max_tokens,
                                                    "temperature": 0})
                lat.append(time.perf_counter() - t0)
                r.raise_for_status()
                toks += r.json()["usage"]["completion_tokens"]
        return lat, toks

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(c) as ex:
        out = list(ex.map(client, per_client))
    wall = time.perf_counter() - t0
    return [x for lat, _ in out for x in lat], wall, sum(t for _, t in out)


def timed_load(base: str, clients: int, requests: int, max_tokens: int, prompt_len: int = 16) -> dict:
    """A fixed serving load on the server at `base`: `requests` completions of `max_tokens` greedy tokens after
    prompts of `prompt_len` random ids below 256 (seed 1), over `clients` threads; one untimed level first.
    Returns req/s, tokens/s, wall seconds and p50 / p99 latency."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, prompt_len).tolist() for _ in range(requests)]
    run_level(base, clients, clients, prompts, max_tokens)  # untimed: connections, caches
    lat, wall, toks = run_level(base, clients, requests, prompts, max_tokens)
    return {"requests_per_s": requests / wall, "tokens_per_s": toks / wall, "wall_s": wall,
            "latency_p50_s": _quantile(lat, 0.5), "latency_p99_s": _quantile(lat, 0.99)}


def _run_server(a, batching: str, prompts, rows: list) -> float:
    """Starts a server in `batching` mode, appends one result row per concurrency level; its startup time [s]."""
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log_file:
        # compile every (rows, prompt columns) shape the run can reach: rows padded to powers of two, columns to 16
        warm_batches = [1 << i for i in range(a.max_batch_size.bit_length()) if 1 << i <= a.max_batch_size]
        warm_lens = list(range(16, -(-a.max_prompt // 16) * 16 + 1, 16))
        t0 = time.perf_counter()
        proc, base = start_server(a.checkpoint, a.max_batch_size, a.batch_wait_ms, log_file, warm_batches,
                                  warm_lens, a.max_tokens, batching)
        startup_s = time.perf_counter() - t0
        print(f"{batching} server up (warmup of {len(warm_batches) * len(warm_lens)} batch shapes) in "
              f"{startup_s:.1f} s", flush=True)
        try:
            for c in a.concurrency:
                run_level(base, c, 2 * c, prompts, a.max_tokens)  # untimed: connections, caches
                n = max(a.requests, 4 * c)
                lat, wall, toks = run_level(base, c, n, prompts, a.max_tokens)
                row = {"batching": batching, "concurrency": c, "requests": n, "wall_s": wall,
                       "requests_per_s": n / wall, "tokens_per_s": toks / wall, "completion_tokens": toks,
                       "latency_p50_ms": 1e3 * _quantile(lat, 0.5), "latency_p99_ms": 1e3 * _quantile(lat, 0.99),
                       "latency_mean_ms": 1e3 * statistics.fmean(lat)}
                rows.append(row)
                print(f"{batching:10s} c={c:3d}  {row['requests_per_s']:7.2f} req/s  {row['tokens_per_s']:8.1f} "
                      f"tok/s  p50 {row['latency_p50_ms']:8.1f} ms  p99 {row['latency_p99_ms']:8.1f} ms", flush=True)
        finally:
            stop_server(proc)
    return startup_s


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=str(repo_root() / "tests" / "fixtures" / "hf" / "qwen3_moe"))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests", type=int, default=64, help="timed requests per level (at least 4 per client)")
    p.add_argument("--max_tokens", type=int, default=16)
    p.add_argument("--min_prompt", type=int, default=8)
    p.add_argument("--max_prompt", type=int, default=32)
    p.add_argument("--max_batch_size", type=int, default=32)
    p.add_argument("--batch_wait_ms", type=float, default=5.0)
    p.add_argument("--batching", nargs="+", default=["continuous"],
                   help="the server's batching mode(s), continuous or bucketed, each optionally with more server "
                        "flags ('continuous --no-row_buckets'); several: one server each, one table")
    p.add_argument("--quick", action="store_true", help="tiny run (smoke test): concurrency 1 2, few requests")
    p.add_argument("--out", default=None, help="JSON output (default benchmarks/results/serve_<backend>.json; "
                                               "the .md table next to it)")
    a = p.parse_args(argv)
    for mode in a.batching:
        if mode.split()[0] not in ("continuous", "bucketed"):
            p.error(f"--batching {mode!r}: must start with 'continuous' or 'bucketed'")
    if a.quick:
        a.concurrency, a.requests, a.max_tokens, a.max_batch_size, a.max_prompt = [1, 2], 4, 4, 2, 16
        a.min_prompt = min(a.min_prompt, a.max_prompt)

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, size=int(rng.integers(a.min_prompt, a.max_prompt + 1))).tolist()
               for _ in range(256)]
    rows, startup = [], {}
    for batching in a.batching:
        startup[batching] = _run_server(a, batching, prompts, rows)

    info = machine_info()
    out = Path(a.out) if a.out else repo_root() / "benchmarks" / "results" / f"serve_{info['backend']}"
    settings = {k: getattr(a, k) for k in ("checkpoint", "max_tokens", "min_prompt", "max_prompt", "max_batch_size",
                                            "batch_wait_ms", "batching")}
    settings["server_startup_s"] = startup
    settings["checkpoint"] = os.path.relpath(settings["checkpoint"], repo_root())
    write_json(out.with_suffix(".json"), {"benchmark": "serve", "settings": settings, "machine": info,
                                          "results": rows})
    table = markdown_table(["batching", "concurrency", "requests", "req/s", "tokens/s", "p50 latency (ms)",
                            "p99 latency (ms)"],
                           [[r["batching"], r["concurrency"], r["requests"], f"{r['requests_per_s']:.2f}",
                             f"{r['tokens_per_s']:.1f}", f"{r['latency_p50_ms']:.1f}", f"{r['latency_p99_ms']:.1f}"]
                            for r in rows])
    text = (f"# Serving benchmark ({info['backend']})\n\n"
            f"`python benchmarks/serve.py`: {settings['checkpoint']}, greedy, max_tokens {a.max_tokens}, prompts of "
            f"{a.min_prompt}-{a.max_prompt} token ids, server --max_batch_size {a.max_batch_size} --batch_wait_ms "
            f"{a.batch_wait_ms} (bucketed only); warm (each server compiled all batch shapes at startup: "
            + ", ".join(f"{k} {v:.0f} s" for k, v in startup.items()) + "; one untimed round per level). "
            f"{info['cpu_affinity']} CPU cores, jax {info['jax_version']}, {info['date']}.\n\n" + table)
    write_text(out.with_suffix(".md"), text)
    print(text)


if __name__ == "__main__":
    main()
