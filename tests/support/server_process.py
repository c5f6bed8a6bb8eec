"""A real `tutel-jax serve` in a subprocess for the server tests: started on a free port, polled until /health
answers (with a deadline, never a hang), then stopped with SIGTERM; its shutdown must be graceful."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest

from tutel_jax.parallel import free_port
from support.paths import REPO




@contextlib.contextmanager
def served(checkpoint: str | os.PathLike, args: Sequence[str], log_dir: Path, healthy_within_s: float = 90,
           no_tracebacks: bool = False) -> Iterator[str]:
    """The base URL of a server on `checkpoint` started with the extra flags `args`. On exit: SIGTERM, uvicorn's
    graceful shutdown (rc 0 or -15, the worker stopped); `no_tracebacks`: the log must hold none (every request
    was handled)."""
    port = free_port()
    log_path = log_dir / "server.log"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "tutel_jax.serving", str(checkpoint), "--host",
                                 "127.0.0.1", "--port", str(port), "--log-level", "info", *args],
                                cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT, text=True)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + healthy_within_s
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
                try:
                    if httpx.get(base + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"server did not become healthy within {healthy_within_s} s")
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
    text = log_path.read_text()
    # uvicorn re-raises the captured SIGTERM after its graceful shutdown: rc -15 (or 0)
    assert rc in (0, -15), (rc, text[-2000:])
    assert "Application shutdown complete" in text and "worker stopped" in text, text[-2000:]
    if no_tracebacks:
        assert "Traceback" not in text, text[-4000:]
