"""Working out which process stopped when a multi-process (`jax.distributed`) job fails.

When a process of a multi-process job dies, the others do not get a clear error. A cross-process collective
fails with whatever the broken connection produces (gloo on CPU: "Connection closed by peer", "Received data
size doesn't match expected size. Is there a distributed collective mismatch?"), or it blocks. Then JAX's
coordination service terminates the survivors from C++ (SIGABRT, "Terminating process because the JAX
distributed service detected fatal errors"). That happens at once when process 0 (the coordinator, which
hosts the service) is gone, and after the heartbeat timeout for any other process. Python cannot catch the
abort. These helpers find out which process stopped, so that a training loop (in the process, while it
can) or a parent process that supervises it (after the abort) can say so; see `examples/train_distributed.py`:

* `dead_peers(timeout)`: in a live process of the job, after a failed step. Process 0 is known to have
  stopped when its service no longer accepts connections (`coordinator_reachable`). For the other processes
  it asks the coordination service which processes are alive (a barrier: see `live_processes`).
* `find_stopped_processes(process_id=..., coordinator_address=..., log_text=...)`: after a process ended,
  from what it wrote to stderr (the processes that JAX's fatal-error message names as stopped) and from
  whether the coordinator can still be reached.
* `stopped_message(stopped, phase)`: the line to print, e.g.
  "process 0 (the coordinator) stopped during step 1; stopping".

Only `live_processes` and `current_coordinator_address` read JAX internals: the distributed client's
`get_live_nodes` and the address the client connected to. Both are guarded and return None when the internals
are not there.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from typing import Iterable

import jax
from jax._src import distributed

__all__ = ["PEER_STOPPED_EXIT_CODE", "current_coordinator_address", "coordinator_reachable", "live_processes",
           "dead_peers", "stopped_processes_in_log", "find_stopped_processes", "stopped_message"]

PEER_STOPPED_EXIT_CODE = 4
"""The exit status `examples/train_distributed.py` uses when it stops because another process stopped."""

# JAX's coordination service, when it declares processes dead (XLA's coordination_service.cc); the ids follow
# on the next lines, as "1" or as a task name ".../task:1":
#   "UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n1\n2\nThe tasks have crashed."
_UNHEALTHY_RE = re.compile(r"tasks? (?:are|is) unhealthy\b[^\n]*:[ \t]*$")
_TASK_LINE_RE = re.compile(r"[ \t]*(?:\S*task:)?(\d+)[ \t,]*")
# Older releases name one task per message: "Task /job:jax_worker/replica:0/task:1 heartbeat timeout."
_TASK_TIMEOUT_RE = re.compile(r"/task:(\d+)\b[^\n]*?(?:heartbeat timeout|stopped sending heartbeats)", re.IGNORECASE)


def current_coordinator_address() -> str | None:
    """The HOST:PORT that this process's `jax.distributed` client connected to, or None when unknown.

    Read from JAX's distributed state (private, guarded). The fallback is the environment variable
    JAX_COORDINATOR_ADDRESS.
    """
    state = _distributed_state()
    address = getattr(state, "coordinator_address", None) if getattr(state, "client", None) is not None else None
    return address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None


def coordinator_reachable(address: str, timeout: float = 2.0) -> bool:
    """Whether something accepts TCP connections at `address` ("HOST:PORT", "[IPv6]:PORT") within `timeout`.

    Process 0 hosts JAX's coordination service at the coordinator address: once that process is gone, the
    connection is refused (or, when its machine is gone, times out). Connecting and closing at once leaves no
    trace in the service. Raises ValueError for an address without a numeric port.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"coordinator address {address!r} is not HOST:PORT")
    host = host.strip("[]") or "127.0.0.1"
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def live_processes(timeout: float) -> set[int] | None:
    """The ids of the processes that JAX's coordination service considers alive, or None when it cannot tell.

    Like a barrier, the service answers once every live process of the job has asked, or once it has declared
    the missing processes dead (after the heartbeat timeout). Processes that all fail together therefore learn
    at once that nobody stopped. Unless JAX's recoverability mode is on (`jax_enable_recoverability`), the
    service also terminates this process when it declares another process dead, so the call does not return
    then. Waits at most `timeout` seconds, in a daemon thread. Returns None when the job is not initialized,
    when this JAX has no such query, when the query fails or when the time runs out.
    """
    client = getattr(_distributed_state(), "client", None)
    get_live_nodes = getattr(client, "get_live_nodes", None)
    if get_live_nodes is None:
        return None

    answer: dict[str, object] = {}

    def ask() -> None:
        try:
            answer["live"] = get_live_nodes(list(range(jax.process_count())))
        except Exception as err:  # noqa: BLE001 - e.g. the service is gone: "cannot tell"
            answer["error"] = err

    thread = threading.Thread(target=ask, name="live_processes", daemon=True)
    thread.start()
    thread.join(max(0.0, timeout))
    live = answer.get("live")
    if live is None:
        return None
    try:
        return {int(i) for i in live}  # a dict {process id: incarnation} in JAX 0.10
    except (TypeError, ValueError):
        return None


def dead_peers(*, timeout: float = 0.0, coordinator_address: str | None = None) -> list[int] | None:
    """The other processes of this `jax.distributed` job that have stopped. [] when all of them are alive;
    None when this cannot be told.

    Call it from a live process after a cross-process operation failed. First, when this process is not
    process 0, it checks whether the coordinator still accepts connections: [0] when it does not. Then, with
    `timeout` > 0, it asks the coordination service which processes are alive (`live_processes`, a barrier:
    see there for what happens when a process is missing). `coordinator_address` defaults to the address
    this process connected to.
    """

    if not jax.distributed.is_initialized():
        return None
    pid, count = jax.process_index(), jax.process_count()
    address = coordinator_address or current_coordinator_address()
    if pid != 0 and address and not coordinator_reachable(address):
        return [0]
    if timeout <= 0:
        return None
    live = live_processes(timeout)
    if live is None:
        if pid != 0 and address and not coordinator_reachable(address):  # it may have gone meanwhile
            return [0]
        return None
    return sorted(set(range(count)) - live - {pid})


def stopped_processes_in_log(text: str) -> list[int]:
    """The process ids that a JAX coordination-service error in `text` (a process's stderr) declares stopped.

    Reads the service's "The following tasks are unhealthy (stopped sending heartbeats):" list (ids, or task
    names ending in "task:N", one per line) and older releases' "Task .../task:N heartbeat timeout". Returns
    them sorted, without repeats; [] when `text` names none. (That process 0, the coordinator, has stopped
    shows in the messages only as a failed connection that might also be a network problem, so it is not
    read from the log: see `coordinator_reachable`.)
    """
    found: set[int] = set()
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if _UNHEALTHY_RE.search(line):
            for following in lines[i + 1:]:
                match = _TASK_LINE_RE.fullmatch(following)
                if match is None:
                    break
                found.add(int(match.group(1)))
        found.update(int(m.group(1)) for m in _TASK_TIMEOUT_RE.finditer(line))
    return sorted(found)


def find_stopped_processes(*, process_id: int, coordinator_address: str | None, log_text: str = "",
                           timeout: float = 2.0) -> list[int]:
    """The processes known to have stopped, seen from process `process_id` after it ended (for example after
    JAX terminated it). These are the ones that its stderr `log_text` names (`stopped_processes_in_log`), plus
    0 when this is another process and nothing accepts connections at the coordinator address within
    `timeout` seconds. `process_id` itself is never in the list; [] when no process is known to have stopped.
    """
    stopped = set(stopped_processes_in_log(log_text))
    if process_id != 0 and coordinator_address and not coordinator_reachable(coordinator_address, timeout):
        stopped.add(0)
    stopped.discard(process_id)
    return sorted(stopped)


def stopped_message(stopped: Iterable[int], phase: str | None = None) -> str:
    """The one line that says which processes stopped: "process 0 (the coordinator) stopped during step 1;
    stopping", "process 1 and process 3 stopped; stopping". `phase` is what this process was doing then."""
    names = [f"process {i} (the coordinator)" if i == 0 else f"process {i}" for i in sorted(set(stopped))]
    if not names:
        raise ValueError("stopped_message needs at least one process id")
    who = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    return f"{who} stopped" + (f" during {phase}" if phase else "") + "; stopping"


def _distributed_state():
    """JAX's `jax.distributed` state object (private; None when this JAX has none)."""
    return getattr(distributed, "global_state", None)
