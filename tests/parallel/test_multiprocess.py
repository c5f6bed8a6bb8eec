"""Multi-process tests of `examples/train_distributed.py`: 2 processes x 4 CPU devices on 127.0.0.1.

* Two processes (gloo collectives, one global 8-device mesh, experts spread over both processes) produce the
  same losses as one process with 8 devices and the same global configuration.
* When one process dies abruptly (`--fail_at_step 1`), the other one exits within a bounded time instead of
  hanging in a collective, and says which process stopped (`process 1 stopped during step 1`, `process 0 (the
  coordinator) stopped during step 1`; status 4) instead of gloo's "Is there a distributed collective
  mismatch?" or JAX's "Terminating process because the JAX distributed service detected fatal errors". JAX
  terminates it once its heartbeat timeout runs out (worker died) or once the connection to the coordinator
  fails (process 0 died). The example's supervising parent process, or the failed step itself, names the
  stopped process.
* `tutel_jax.parallel._failures`' helpers on JAX's error messages and on the coordinator check, in-process.

Every subprocess runs under a deadline and is killed in a `finally`, so a hang fails the test instead of CI.
"""

from __future__ import annotations

import re
import socket
import sys
import time

import numpy as np
import pytest

from tutel_jax.parallel._local_launch import ProcessResult, child_env, free_port, run_processes
from support.xla_flags import with_fast_compile
from support.paths import REPO

SCRIPT = REPO / "examples" / "train_distributed.py"
DEADLINE_S = 180  # per launch; a hung job is killed after this and the test fails
STEP_RE = re.compile(r"^step (\d+) loss (\S+)", re.MULTILINE)
# small global problem: 8 devices x 2 samples x 16 tokens, 16 experts (2 per device), top-2
CONFIG = ["--batch_per_device", "2", "--num_tokens", "16", "--model_dim", "32", "--hidden_size", "64",
          "--count_per_node", "2", "--top", "2", "--capacity_factor", "1.0", "--optimizer", "adam",
          "--lr", "0.01", "--seed", "0"]
NUM_STEPS = 8


def _losses(result: ProcessResult) -> list[float]:
    steps = STEP_RE.findall(result.output)
    assert [int(i) for i, _ in steps] == list(range(len(steps))), result.output
    return [float(loss) for _, loss in steps]


def launch(commands: list[list[str]], deadline_s: float = DEADLINE_S) -> tuple[list[ProcessResult], float]:
    """Starts all commands of the example at once, waits for all of them (at most `deadline_s`), kills what is
    left (`local_launch.run_processes`). Returns (one ProcessResult per command, wall time)."""
    # CPU only; (XLA_FLAGS may stay: --local_devices replaces its device count). Compiling is most of a tiny
    # run's time: without LLVM optimisation it is about a third less (every run of a comparison alike).
    env = child_env(JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = with_fast_compile(env.get("XLA_FLAGS", ""))
    start = time.monotonic()
    results = run_processes([[sys.executable, str(SCRIPT), *cmd] for cmd in commands], timeout=deadline_s,
                            env=env, cwd=REPO)
    return results, time.monotonic() - start


def _describe(results: list[ProcessResult]) -> str:
    return "\n".join(f"--- process {i}: returncode {r.returncode}\n{r.output[-4000:]}" for i, r in enumerate(results))


def two_process_commands(extra: list[list[str]], common: list[str]) -> list[list[str]]:
    address = f"127.0.0.1:{free_port()}"
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
    losses0, losses1, reference = _losses(multi[0]), _losses(multi[1]), _losses(single[0])
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
    assert len(_losses(alive)) <= 1, _describe(results)  # step 1 needs the dead process: it never finishes
    # the survivor says which process stopped (not only gloo's "collective mismatch" or JAX's abort)
    stopped = re.compile(rf"^\[process {survivor}\] error: process {dying}( \(the coordinator\))? stopped during "
                         r"step 1; stopping$", re.MULTILINE)
    assert stopped.search(alive.output), _describe(results)
    assert "collective mismatch" not in alive.output or stopped.search(alive.output), _describe(results)
    assert alive.returncode == 4, _describe(results)  # the example's status for "another process stopped"
    assert not re.search(r"process \d+( \(the coordinator\))? stopped", dead.output), _describe(results)
    detection_s = alive.exit_time - dead.exit_time
    print(f"process {dying} died; process {survivor} exited with {alive.returncode} {detection_s:.1f} s later "
          f"(wall {wall:.1f} s)")
    assert detection_s < 45, f"the survivor took {detection_s:.1f} s to exit\n" + _describe(results)


# ----------------------------------------------------------------------------------------------------------
# tutel_jax.parallel._failures, in this process
# ----------------------------------------------------------------------------------------------------------
# what a survivor's stderr holds after JAX 0.10 terminated it (worker 1 died; process 0 hosts the service)
WORKER_DIED_LOG = """\
step 0 loss 0.436869949  (dropped 0.225, 4.800 s)
E1202 01:07:01.411562   20188 coordination_service.cc:1549] [13243617452878297523] Use error polling to propagate \
the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
1
The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, eviction) to \
debug further. [type.googleapis.com/tensorflow.CoordinationServiceError='']
F1202 01:07:01.412327   20199 client.h:80] Terminating process because the JAX distributed service detected fatal \
errors. This most likely indicates that another task died; see the other task logs for more details. absl::Status: \
UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
1
The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, eviction) to \
debug further.
*** Check failure stack trace: ***
"""
# process 0 died: the survivor's gloo collective and its connection to the service fail
COORDINATOR_DIED_LOG = """\
F1202 00:50:14.733047    8882 client.h:80] Terminating process because the JAX distributed service detected fatal \
errors. absl::Status: UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was \
preempted/died/restarted unexpectedly or this task is experiencing network issues.
jax.errors.JaxRuntimeError: UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:547] \
Received data size doesn't match expected size. Is there a distributed collective mismatch?
"""


def test_stopped_processes_in_log() -> None:
    from tutel_jax.parallel._failures import stopped_processes_in_log

    assert stopped_processes_in_log(WORKER_DIED_LOG) == [1]
    assert stopped_processes_in_log(COORDINATOR_DIED_LOG) == []  # the coordinator is checked by connecting
    several = ("UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n"
               "3\n/job:jax_worker/replica:0/task:2\nThe tasks have crashed.")
    assert stopped_processes_in_log(several) == [2, 3]
    assert stopped_processes_in_log("Task /job:jax_worker/replica:0/task:5 heartbeat timeout. This indicates") == [5]
    assert stopped_processes_in_log("step 1 loss 0.5\nall good\n") == []


def test_stopped_message() -> None:
    from tutel_jax.parallel import stopped_message

    assert stopped_message([0], "step 1") == "process 0 (the coordinator) stopped during step 1; stopping"
    assert stopped_message([3, 1]) == "process 1 and process 3 stopped; stopping"
    assert stopped_message([2, 0, 1], "shutdown") == (
        "process 0 (the coordinator), process 1 and process 2 stopped during shutdown; stopping")
    with pytest.raises(ValueError):
        stopped_message([])


def test_coordinator_check_and_find_stopped_processes() -> None:
    from tutel_jax.parallel._failures import coordinator_reachable, dead_peers, find_stopped_processes

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        live = f"127.0.0.1:{listener.getsockname()[1]}"
        assert coordinator_reachable(live)
        # a survivor whose coordinator is alive: only what the log names
        assert find_stopped_processes(process_id=1, coordinator_address=live, log_text=COORDINATOR_DIED_LOG) == []
        assert find_stopped_processes(process_id=0, coordinator_address=live, log_text=WORKER_DIED_LOG) == [1]
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    assert not coordinator_reachable(dead)
    assert find_stopped_processes(process_id=1, coordinator_address=dead, log_text=COORDINATOR_DIED_LOG) == [0]
    assert find_stopped_processes(process_id=2, coordinator_address=dead, log_text=WORKER_DIED_LOG) == [0, 1]
    assert find_stopped_processes(process_id=1, coordinator_address=None, log_text=WORKER_DIED_LOG) == []
    with pytest.raises(ValueError):
        coordinator_reachable("127.0.0.1")
    assert dead_peers(timeout=1.0) is None  # not a multi-process job: cannot tell


def test_supervisor_names_the_stopped_process(capsys) -> None:
    """The example's parent process, after JAX killed the child (SIGABRT) without a word from Python."""
    import importlib.util
    import signal

    spec = importlib.util.spec_from_file_location("train_distributed_example", SCRIPT)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    abort = -signal.SIGABRT
    dead = f"127.0.0.1:{free_port()}"
    status = {"process": "1", "coordinator": dead, "phase": "step 1"}
    assert example.explain_child_failure(abort, status, COORDINATOR_DIED_LOG) == 4
    assert capsys.readouterr().err == "[process 1] error: process 0 (the coordinator) stopped during step 1; stopping\n"
    status = {"process": "0", "coordinator": dead, "phase": "step 1"}
    assert example.explain_child_failure(abort, status, WORKER_DIED_LOG) == 4
    assert capsys.readouterr().err == "[process 0] error: process 1 stopped during step 1; stopping\n"
    # nothing tells of a stopped process: the signal is reported as such
    assert example.explain_child_failure(abort, {"process": "0", "phase": "step 2"}, "no JAX error here") == 134
    assert capsys.readouterr().err == "[process 0] error: terminated by SIGABRT during step 2\n"
    assert example.explain_child_failure(1, {"process": "0"}, "Traceback ...") == 1
    assert capsys.readouterr().err == ""


def test_a_hung_child_prints_its_stacks_before_it_is_killed() -> None:
    code = ("import time\nfrom tutel_jax.parallel._local_launch import dump_stacks_on_signal\n"
            "dump_stacks_on_signal()\nprint('ready', flush=True)\n"
            "def wait_for_a_peer():\n    time.sleep(600)\nwait_for_a_peer()\n")
    start = time.monotonic()
    (result,) = run_processes([[sys.executable, "-c", code]], timeout=8.0, env=child_env(), cwd=REPO)
    assert time.monotonic() - start < 30
    assert result.killed and result.returncode is None
    assert "ready" in result.output
    assert "Current thread" in result.output and "in wait_for_a_peer" in result.output, result.output
