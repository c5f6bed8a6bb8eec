"""Several processes of one job on this machine (a `jax.distributed` cluster on 127.0.0.1), under a deadline.

`run_processes` starts every command at once and waits for them, and kills whatever is still running at the
deadline (or, with `stop_on_failure`, as soon as one of them fails), in a `finally`: a hung collective never
hangs the caller. A child that called `dump_stacks_on_signal()` first prints every thread's Python stack when the
deadline passes, so the output of a hung job shows where each process waited. Output goes to temporary files
rather than pipes, so a chatty child can never block on a full pipe. The module itself uses only the standard
library.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import signal
import socket
import subprocess
import tempfile
import time
from typing import Mapping, Sequence

__all__ = ["ProcessResult", "free_port", "child_env", "run_processes", "dump_stacks_on_signal"]

# Cluster variables a child must not inherit: each one is told its place by its arguments.
_CLUSTER_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS")
# Sent to the children still running at the deadline, before they are killed.
STACK_SIGNAL = signal.SIGUSR1
_STACK_WAIT_S = 3.0


def dump_stacks_on_signal() -> None:
    """In a child: print every thread's Python stack to stderr on STACK_SIGNAL (run_processes sends it to the
    children still running at its deadline, then kills them)."""
    faulthandler.register(STACK_SIGNAL, all_threads=True)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (for a coordinator or a server)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def child_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """`base` (default os.environ) without proxy settings (gRPC to 127.0.0.1 must not go through a proxy) or
    JAX cluster variables, with unbuffered Python output, plus `extra`."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if "_proxy" not in k.lower() and k not in _CLUSTER_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


@dataclasses.dataclass
class ProcessResult:
    """One child: `returncode` (None: still running at the deadline, then killed; a child stopped because
    another failed reads as killed too), `output` (stdout + stderr; empty for a relayed child) and `exit_time`
    (time.monotonic() when its exit was seen, or None)."""

    returncode: int | None
    output: str
    exit_time: float | None

    @property
    def killed(self) -> bool:
        return self.exit_time is None


def run_processes(commands: Sequence[Sequence[str]], *, timeout: float, env: Mapping[str, str] | None = None,
                  cwd: str | os.PathLike | None = None, relay: int | None = None, stop_on_failure: bool = False,
                  poll_s: float = 0.1) -> list[ProcessResult]:
    """Runs all `commands` (argv lists) at once; returns one ProcessResult each, in order.

    Args:
      timeout: seconds from the start after which every child still running is killed.
      env: the children's environment (default `child_env()`); cwd: their working directory.
      relay: index of a child whose output goes straight to this process's stdout / stderr (live).
      stop_on_failure: kill the others as soon as one exits with a non-zero status.
    """
    env = child_env() if env is None else dict(env)
    procs: list[subprocess.Popen] = []
    logs: list = []
    exit_times: list[float | None] = [None] * len(commands)
    deadline = time.monotonic() + timeout
    try:
        for i, cmd in enumerate(commands):
            log = None if i == relay else tempfile.TemporaryFile(mode="w+")
            logs.append(log)
            procs.append(subprocess.Popen(list(cmd), cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=None if log is None else subprocess.STDOUT))
        while time.monotonic() < deadline:
            for i, proc in enumerate(procs):
                if exit_times[i] is None and proc.poll() is not None:
                    exit_times[i] = time.monotonic()
            if all(t is not None for t in exit_times):
                break
            if stop_on_failure and any(t is not None and p.returncode for t, p in zip(exit_times, procs)):
                break
            time.sleep(poll_s)
    finally:
        running = [proc for proc in procs if proc.poll() is None]
        if running and time.monotonic() >= deadline:  # a hang: where is each process waiting?
            for proc in running:
                proc.send_signal(STACK_SIGNAL)
            time.sleep(_STACK_WAIT_S)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover - a process that ignores SIGKILL
                pass
    results = []
    for i, log in enumerate(logs):
        output = ""
        if log is not None:
            log.seek(0)
            output = log.read()
            log.close()
        results.append(ProcessResult(procs[i].returncode if exit_times[i] is not None else None, output,
                                     exit_times[i]))
    return results
