"""Multi-process tests of `examples/train_distributed.py`: 2 processes x 4 CPU devices on 127.0.0.1.

* Two processes (gloo collectives, one global 8-device mesh, experts spread over both processes) produce the
  same losses as one process with 8 devices and the same global configuration.
* When one process dies abruptly (`--fail_at_step 1`), the other one exits non-zero within a bounded time
  instead of hanging in a collective: the JAX coordination service's heartbeat timeout (worker died) or the
  lost connection to the coordinator (process 0 died) terminates it.

Every subprocess runs under a deadline and is killed in a `finally`, so a hang fails the test instead of CI.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "train_distributed.py"
DEADLINE_S = 180  # per launch; a hung job is killed after this and the test fails
STEP_RE = re.compile(r"^step (\d+) loss (\S+)", re.MULTILINE)
# small global problem: 8 devices x 2 samples x 16 tokens, 16 experts (2 per device), top-2
CONFIG = ["--batch_per_device", "2", "--num_tokens", "16", "--model_dim", "32", "--hidden_size", "64",
          "--count_per_node", "2", "--top", "2", "--capacity_factor", "1.0", "--optimizer", "adam",
          "--lr", "0.01", "--seed", "0"]
NUM_STEPS = 8


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env() -> dict[str, str]:
    """CPU only; no inherited proxy settings (gRPC to 127.0.0.1 must not go through a proxy) or JAX cluster vars."""
    env = {k: v for k, v in os.environ.items() if "_proxy" not in k.lower()}
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS"):
        env.pop(name, None)  # (XLA_FLAGS may stay: --local_devices replaces its device count)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Result:
    def __init__(self, returncode: int | None, output: str, exit_time: float | None):
        self.returncode = returncode  # None: still running at the deadline (then killed)
        self.output = output
        self.exit_time = exit_time  # time.monotonic() when the exit was observed

    def losses(self) -> list[float]:
        steps = STEP_RE.findall(self.output)
        assert [int(i) for i, _ in steps] == list(range(len(steps))), self.output
        return [float(loss) for _, loss in steps]


def launch(commands: list[list[str]], deadline_s: float = DEADLINE_S) -> tuple[list[Result], float]:
    """Starts all commands at once, waits for all of them (at most `deadline_s`), kills what is left.

    Returns (one Result per command, wall time). Output goes to temporary files, not pipes, so a chatty
    process can never block on a full pipe.
    """
    env = _child_env()
    procs: list[subprocess.Popen] = []
    logs = []
    exit_times: list[float | None] = [None] * len(commands)
    start = time.monotonic()
    try:
        for cmd in commands:
            log = tempfile.TemporaryFile(mode="w+")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, str(SCRIPT), *cmd], cwd=REPO, env=env, stdout=log,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        while time.monotonic() - start < deadline_s:
            for i, proc in enumerate(procs):
                if exit_times[i] is None and proc.poll() is not None:
                    exit_times[i] = time.monotonic()
            if all(t is not None for t in exit_times):
                break
            time.sleep(0.1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover - a process that ignores SIGKILL
                pass
    wall = time.monotonic() - start
    results = []
    for i, log in enumerate(logs):
        log.seek(0)
        output = log.read()
        log.close()
        code = procs[i].returncode if exit_times[i] is not None else None
        results.append(Result(code, output, exit_times[i]))
    return results, wall


def _describe(results: list[Result]) -> str:
    return "\n".join(f"--- process {i}: returncode {r.returncode}\n{r.output[-4000:]}" for i, r in enumerate(results))


def two_process_commands(extra: list[list[str]], common: list[str]) -> list[list[str]]:
    address = f"127.0.0.1:{_free_port()}"
    return [["--coordinator_address", address, "--num_processes", "2", "--process_id", str(pid),
             "--local_devices", "4", *CONFIG, *common, *extra[pid]] for pid in range(2)]


def test_two_processes_match_one_process() -> None:
    common = ["--num_steps", str(NUM_STEPS), "--heartbeat_timeout", "30", "--step_timeout", "120"]
    multi, multi_wall = launch(two_process_commands([[], []], common))
    assert all(r.returncode == 0 for r in multi), _describe(multi)
    single, single_wall = launch([["--num_processes", "1", "--local_devices", "8", *CONFIG, *common]])
    assert single[0].returncode == 0, _describe(single)
    print(f"2 processes x 4 devices: {multi_wall:.1f} s; 1 process x 8 devices: {single_wall:.1f} s")

    for r in multi:
        assert "8 global" in r.output and "experts: 16" in r.output, r.output
        assert "done" in r.output, r.output
    losses0, losses1, reference = multi[0].losses(), multi[1].losses(), single[0].losses()
    assert len(reference) == NUM_STEPS and np.all(np.isfinite(reference)), single[0].output
    assert reference[-1] < reference[0], f"loss does not decrease: {reference}"
    # the loss is a replicated global value: both processes report it
    np.testing.assert_allclose(losses0, losses1, rtol=1e-6, atol=0)
    # same global computation (same token partitions per device, same expert placement); only the order of
    # cross-device float reductions may differ between gloo and the in-process collectives
    np.testing.assert_allclose(losses0, reference, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dying", [1, 0], ids=["worker_dies", "coordinator_dies"])
def test_dead_process_does_not_hang(dying: int) -> None:
    heartbeat_s = 5
    # the step watchdog is only a back-up here (60 s): the survivor must be stopped by JAX's failure detection
    common = ["--num_steps", "50", "--heartbeat_timeout", str(heartbeat_s), "--step_timeout", "60"]
    extra: list[list[str]] = [[], []]
    extra[dying] = ["--fail_at_step", "1"]
    results, wall = launch(two_process_commands(extra, common))
    survivor = 1 - dying
    dead, alive = results[dying], results[survivor]
    assert dead.returncode is not None and alive.returncode is not None, (
        f"a process was still running after {DEADLINE_S} s (hang)\n" + _describe(results))
    assert dead.returncode == 1, _describe(results)
    assert "--fail_at_step 1" in dead.output, _describe(results)
    assert alive.returncode != 0, _describe(results)
    assert "done" not in alive.output, _describe(results)
    assert len(alive.losses()) <= 1, _describe(results)  # step 1 needs the dead process: it never finishes
    detection_s = alive.exit_time - dead.exit_time
    print(f"process {dying} died; process {survivor} exited with {alive.returncode} {detection_s:.1f} s later "
          f"(wall {wall:.1f} s)")
    assert detection_s < 45, f"the survivor took {detection_s:.1f} s to exit\n" + _describe(results)
