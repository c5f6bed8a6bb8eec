#!/usr/bin/env python3
"""Multi-process expert-parallel MoE training: one MoE layer trained over the GLOBAL mesh of all processes.

Every process runs this script (one process per host, or several on one machine for testing). All devices of
all processes form one 1-D mesh ('expert',) over `jax.devices()`; the MoE layer's experts are spread over ALL
of them (E = `--count_per_node` x number of global devices) and each device routes its own slice of the batch,
exchanging tokens with `all_to_all` (`tutel_jax.parallel.moe_apply_parallel`), like one Tutel rank per device.

Model (an embedding-free toy in the spirit of Tutel's helloworld)::

    h = x @ W_in                        # Dense projection, replicated parameter [M, M]
    y, aux = moe_apply_parallel(h)      # top-k gate (replicated) + ffn experts (sharded over all devices)
    loss = mean((y - target)^2) + l_aux_wt * aux.l_aux

x [global_batch, num_tokens, model_dim] (normal) and target = tanh(x @ R) (R a fixed random matrix) are drawn
with numpy from `--seed`: the same global arrays on every process, the same every step; global_batch =
`--batch_per_device` x global device count. Each process only materialises the shards of its own devices
(`jax.make_array_from_callback`). Parameters are initialised identically on every process and placed with
`shard_params` (gates and W_in replicated, experts split). Because the global arrays, the mesh order and the
per-device token partitions only depend on the global device count, a run with 2 processes x 4 devices
computes the same thing as 1 process x 8 devices (up to the order of float additions in the collectives).

Every process prints one line per step, in the same format (the loss is a replicated global value)::

    step <i> loss <L>  (dropped <fraction of assignments over capacity>, <seconds> s)

Process set-up (`jax.distributed.initialize`):
  * `--coordinator_address HOST:PORT`, `--num_processes N`, `--process_id I`. A flag that is not given is read
    from the environment: JAX_COORDINATOR_ADDRESS (also read by JAX itself), JAX_NUM_PROCESSES and
    JAX_PROCESS_ID (defined by this script; JAX itself does not read the last two). If the address is known
    but the count or id are not, JAX's own cluster auto-detection fills them in (Slurm, Open MPI, mpi4py,
    Cloud TPU, Kubernetes).
  * With num_processes 1, or no coordinator address and no number of processes anywhere, the script runs as a
    single process without calling `jax.distributed.initialize`.
  * On CPU, cross-process collectives use gloo (`jax_cpu_collectives_implementation`); the number of CPU
    devices per process is `--local_devices` (default 4; sets XLA_FLAGS=--xla_force_host_platform_device_count
    before JAX is imported; without the flag an existing setting in XLA_FLAGS is kept). It has no effect on
    GPU/TPU backends.
  * Failure detection: if a process dies, the others must not hang, and they say which process stopped.
    `--heartbeat_timeout S` (default 10 s) is passed to the JAX coordination service: a process that stops
    heartbeating for S seconds is declared dead and JAX terminates the surviving processes from C++ (SIGABRT,
    "Terminating process because the JAX distributed service detected fatal errors"). If process 0 (the
    coordinator) dies, the others end as soon as their connection to it fails, without waiting for the
    timeout. A collective whose peer died may also fail first, with whatever the broken connection gives
    (gloo: "Connection closed by peer", "Received data size doesn't match expected size. Is there a
    distributed collective mismatch?"), or it may block.
    Either way the survivor prints one line, `[process I] error: process 0 (the coordinator) stopped during
    step 1; stopping` (or `process N stopped ...`), and exits with status 4:
      - a step (or the start-up, or the shutdown) that raises first checks whether process 0 still accepts
        connections, then asks the coordination service which processes are alive
        (`tutel_jax.parallel._failures.dead_peers`). If all of them are, the original error is raised. If the
        question cannot be answered, the error is raised after S + 5 seconds, which leaves JAX the time to
        declare a dead process;
      - JAX's abort cannot be caught in Python, so the script runs itself as a child process, and the
        parent names the stopped process after the child ends. The parent relays the child's stderr and keeps
        its last 256 KiB, where JAX names the processes it declared dead; it also checks whether the
        coordinator can still be reached. The parent imports no JAX unless the child failed. It exits with the child's
        status, 4 when a process stopped, 128 + N when the child was killed by signal N for another reason.
        It passes SIGTERM and SIGHUP on to the child; Ctrl-C reaches both, and the parent waits for the
        child. If the parent is killed, the child exits. `--no_supervisor` runs without the parent.
    As a second line of defence, `--step_timeout S` (default 120 s, 0 disables) makes this process exit with
    status 3 when one step (including its compilation), the start-up placement or the final shutdown barrier
    takes longer than S seconds (status 4 if the coordinator is gone by then).
    `--init_timeout S` (default 60 s) bounds how long `initialize` waits for all processes to connect.
  * `--fail_at_step K` (testing): this process calls os._exit(1) at the start of step K, without any cleanup.

Examples (two processes on one machine, 4 CPU devices each)::

    python examples/train_distributed.py --coordinator_address 127.0.0.1:12345 --num_processes 2 --process_id 0 &
    python examples/train_distributed.py --coordinator_address 127.0.0.1:12345 --num_processes 2 --process_id 1

    # the same global computation in one process with 8 devices
    python examples/train_distributed.py --num_processes 1 --local_devices 8
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Sequence

DEFAULT_LOCAL_DEVICES = 4
SUPERVISOR_ENV = "TUTEL_JAX_SUPERVISOR_FDS"  # set for the child: "<status pipe fd>,<lifeline pipe fd>"
STDERR_TAIL_BYTES = 1 << 18  # how much of the child's stderr the supervisor keeps to read JAX's error from


# ----------------------------------------------------------------------------------------------------------
# Supervisor: the parent process (standard library only; it runs before JAX is imported)
# ----------------------------------------------------------------------------------------------------------
def supervise(argv: Sequence[str]) -> int:
    """Runs this script again as a child process and explains how it ended. Returns the exit status.

    JAX terminates a process from C++ (SIGABRT) when its distributed service detects that a process has
    stopped, and Python cannot report anything then. This parent outlives the child, so it can name the
    stopped process. It relays the child's stderr and keeps the tail (JAX's error names the processes it
    declared dead). Through a pipe, the child sends its process id, the coordinator address, its current
    phase and any exit status it chose itself. A second pipe stays open for the parent's lifetime: the child
    exits when it closes (when the parent is killed).
    """
    import signal
    import subprocess
    import threading

    status_r, status_w = os.pipe()
    lifeline_r, _lifeline_w = os.pipe()  # never written: the write end closes when this process ends
    stderr_r, stderr_w = os.pipe()
    env = dict(os.environ, **{SUPERVISOR_ENV: f"{status_w},{lifeline_r}"})
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], env=env, stderr=stderr_w,
                             pass_fds=(status_w, lifeline_r))
    for fd in (status_w, lifeline_r, stderr_w):
        os.close(fd)

    def forward(signum, _frame):
        if child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGHUP, forward)
    signal.signal(signal.SIGINT, lambda _signum, _frame: None)  # Ctrl-C reaches the child as well

    tail = bytearray()
    status: dict[str, str] = {}

    def relay_stderr() -> None:
        while chunk := os.read(stderr_r, 1 << 16):
            tail.extend(chunk)
            del tail[:-STDERR_TAIL_BYTES]
            view = memoryview(chunk)
            while view:
                try:
                    view = view[os.write(2, view):]
                except OSError:  # our stderr is gone: keep draining the child's
                    break

    def read_status() -> None:
        with open(status_r, encoding="utf-8", errors="replace") as lines:
            for line in lines:
                key, _, value = line.rstrip("\n").partition(" ")
                status[key] = value

    threads = [threading.Thread(target=target, daemon=True) for target in (relay_stderr, read_status)]
    for thread in threads:
        thread.start()
    code = child.wait()
    for thread in threads:
        thread.join(timeout=10)
    if code == 0:
        return 0
    if "exit" in status:  # the child said why it stops (and printed it)
        return int(status["exit"])
    return explain_child_failure(code, status, tail.decode("utf-8", errors="replace"))


def say_line(line: str) -> None:
    """Writes `line` and its newline to stderr in one write. (The runs are unbuffered, PYTHONUNBUFFERED=1, where
    print() writes the text and the newline separately: JAX's own log lines, written straight to the same pipe
    from other threads, could land between them and split the line.)"""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def explain_child_failure(code: int, status: dict[str, str], log_text: str) -> int:
    """The supervisor's report on a child that failed without saying why. Returns the exit status."""
    import signal

    pid, phase = status.get("process"), status.get("phase")
    prefix = f"[process {pid}] " if pid is not None else ""
    during = f" during {phase}" if phase else ""
    if pid is not None:  # a member of a multi-process job: did another process stop?
        try:
            from tutel_jax.parallel import PEER_STOPPED_EXIT_CODE, find_stopped_processes, stopped_message

            stopped = find_stopped_processes(process_id=int(pid), coordinator_address=status.get("coordinator"),
                                             log_text=log_text)
        except Exception as err:  # noqa: BLE001 - the report must not hide the child's failure
            say_line(f"{prefix}warning: could not tell whether another process stopped: {err}")
            stopped = []
        if stopped:
            say_line(f"{prefix}error: {stopped_message(stopped, phase)}")
            return PEER_STOPPED_EXIT_CODE
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        say_line(f"{prefix}error: terminated by {name}{during}")
        return 128 - code
    return code


if __name__ == "__main__" and SUPERVISOR_ENV not in os.environ and "--no_supervisor" not in sys.argv[1:]:
    sys.exit(supervise(sys.argv[1:]))

from tutel_jax.cli_args import (ensure_host_device_count, finite_float, int_at_least, non_negative_float,
                                positive_float, set_host_device_count)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="train_distributed.py",
        description="Multi-process expert-parallel MoE training over the global device mesh.")
    group = parser.add_argument_group("processes")
    group.add_argument("--coordinator_address", type=str, default=None,
                       help="HOST:PORT of process 0's coordinator (default: $JAX_COORDINATOR_ADDRESS)")
    group.add_argument("--num_processes", type=int_at_least(1), default=None,
                       help="number of processes (default: $JAX_NUM_PROCESSES, else auto-detected; 1 = no initialize)")
    group.add_argument("--process_id", type=int_at_least(0), default=None,
                       help="this process's id in [0, num_processes) (default: $JAX_PROCESS_ID, else auto-detected)")
    group.add_argument("--local_devices", type=int_at_least(1), default=None,
                       help=f"CPU devices per process (default {DEFAULT_LOCAL_DEVICES}, or XLA_FLAGS' setting)")
    group.add_argument("--init_timeout", type=int_at_least(1), default=60,
                       help="seconds to wait for all processes to connect (default 60)")
    group.add_argument("--heartbeat_timeout", type=int_at_least(1), default=10,
                       help="seconds without heartbeats after which a process is declared dead (default 10)")
    group.add_argument("--step_timeout", type=non_negative_float, default=120.0,
                       help="exit with status 3 when a step takes longer than this (seconds; 0 = never; default 120)")
    group.add_argument("--fail_at_step", type=int_at_least(0), default=None,
                       help="testing: os._exit(1) at the start of this step")
    group.add_argument("--no_supervisor", action="store_true",
                       help="run in this process, without the parent that reports a process killed by JAX")
    model = parser.add_argument_group("model and training")
    model.add_argument("--num_steps", type=int_at_least(1), default=10)
    model.add_argument("--batch_per_device", type=int_at_least(1), default=2, help="samples per device (default 2)")
    model.add_argument("--num_tokens", type=int_at_least(1), default=16, help="tokens per sample (default 16)")
    model.add_argument("--model_dim", type=int_at_least(1), default=32)
    model.add_argument("--hidden_size", type=int_at_least(1), default=64, help="hidden size per expert")
    model.add_argument("--count_per_node", type=int_at_least(1), default=2, help="experts per device (default 2)")
    model.add_argument("--top", type=int_at_least(1), default=2, help="k of the top-k gate (default 2)")
    model.add_argument("--capacity_factor", type=finite_float, default=1.0,
                       help="> 0 fixed capacity, 0 dropless, < 0 bounded dropless (Tutel semantics; default 1)")
    model.add_argument("--l_aux_wt", type=finite_float, default=0.01, help="weight of the load-balancing loss")
    model.add_argument("--optimizer", choices=("sgd", "adam"), default="adam")
    model.add_argument("--lr", type=positive_float, default=0.01)
    model.add_argument("--seed", type=int, default=0, help="seed of the data and of the parameters")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses the flags and resolves the process set-up from the environment (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)

    def from_env(name: str, flag: str, minimum: int) -> int | None:
        text = os.environ.get(name, "").strip()
        if not text:
            return None
        try:
            value = int(text)
        except ValueError:
            parser.error(f"environment variable {name}={text!r} is not an integer (or pass {flag})")
        if value < minimum:
            parser.error(f"environment variable {name}={value} must be >= {minimum} (or pass {flag})")
        return value

    if args.coordinator_address is None:
        args.coordinator_address = os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    if args.num_processes is None:
        args.num_processes = from_env("JAX_NUM_PROCESSES", "--num_processes", 1)
    if args.process_id is None:
        args.process_id = from_env("JAX_PROCESS_ID", "--process_id", 0)
    if args.num_processes is not None and args.process_id is not None and args.process_id >= args.num_processes:
        parser.error(f"process_id {args.process_id} must be < num_processes {args.num_processes}")
    if not is_multi_process(args) and args.process_id not in (None, 0):
        parser.error(f"process_id {args.process_id} given, but this is a single-process run (pass "
                     "--num_processes and --coordinator_address, or set JAX_NUM_PROCESSES / JAX_COORDINATOR_ADDRESS)")
    return args


def is_multi_process(args: argparse.Namespace) -> bool:
    """Whether to call jax.distributed.initialize: not when the count is 1 or nothing describes a cluster."""
    if args.num_processes == 1:
        return False
    return args.num_processes is not None or args.coordinator_address is not None


def set_local_device_count(count: int | None) -> None:
    """Sets the number of host (CPU) devices in XLA_FLAGS; must run before JAX initialises its backends."""
    if count is None:
        ensure_host_device_count(DEFAULT_LOCAL_DEVICES)
    else:
        set_host_device_count(count)


# Parse before any device use: the device count must be in XLA_FLAGS before the backend starts.
if __name__ == "__main__":
    ARGS = parse_args()
    set_local_device_count(ARGS.local_devices)

import contextlib  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from tutel_jax import init_params, make_config  # noqa: E402
from tutel_jax.parallel import ExpertParallel, moe_apply_parallel, shard_params  # noqa: E402
from tutel_jax.parallel import dump_stacks_on_signal  # noqa: E402
from tutel_jax.parallel import PEER_STOPPED_EXIT_CODE, current_coordinator_address, dead_peers, stopped_message


# ----------------------------------------------------------------------------------------------------------
# Process set-up
# ----------------------------------------------------------------------------------------------------------
def initialize_distributed(args: argparse.Namespace) -> None:
    """Calls jax.distributed.initialize when several processes take part (before any other JAX call)."""
    if not is_multi_process(args):
        return
    dump_stacks_on_signal()  # a launcher's deadline shows where a hung process waited
    # gloo is JAX 0.10's default for CPU cross-process collectives; set it explicitly for older versions.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=args.coordinator_address,
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=args.init_timeout,
        heartbeat_timeout_seconds=args.heartbeat_timeout,
        # a finishing process waits this long for the others at shutdown before giving up
        shutdown_timeout_seconds=max(args.heartbeat_timeout, 30),
    )


class SupervisorLink:
    """This process's end of `supervise`'s pipes; does nothing when the script runs without the supervisor.

    `send(key, value)` writes one "key value" line to the parent (process, coordinator, phase, exit). A
    daemon thread waits on the lifeline pipe and exits this process when the parent is gone.
    """

    def __init__(self, spec: str | None):
        self._status_fd: int | None = None
        if not spec:
            return
        status_fd, lifeline_fd = (int(fd) for fd in spec.split(","))
        self._status_fd = status_fd
        threading.Thread(target=self._watch_parent, args=(lifeline_fd,), name="supervisor-lifeline",
                         daemon=True).start()

    def send(self, key: str, value: object = "") -> None:
        if self._status_fd is not None:
            try:
                os.write(self._status_fd, f"{key} {value}\n".encode())  # one short write: atomic on a pipe
            except OSError:  # the parent is gone; the lifeline thread ends this process
                pass

    @staticmethod
    def _watch_parent(fd: int) -> None:
        try:
            os.read(fd, 1)  # b"" once the parent has exited: it holds the only write end
        except OSError:
            pass
        os._exit(1)  # (nothing to print: our stderr was the parent's pipe)


def stop(link: SupervisorLink, code: int, message: str) -> None:
    """Prints `[process I] error: MESSAGE`, tells the supervisor the exit status and exits at once.

    (Printed first: if JAX terminates this process in between, the supervisor still has a report to make.)
    """
    say_line(f"[process {jax.process_index()}] error: {message}")
    link.send("exit", code)
    os._exit(code)


def stop_if_a_process_stopped(link: SupervisorLink, phase: str, wait: float) -> None:
    """After `phase` failed, exits with status 4 and one clear line when another process of the job stopped.

    A collective whose peer died fails with whatever the broken connection gives (gloo: "Connection closed
    by peer", "... Is there a distributed collective mismatch?"). Process 0 is checked at once: does it still
    accept connections? For the others, the coordination service is asked which processes are alive. When
    all processes fail together, they all learn at once that nobody stopped, and this function returns: the
    caller raises the original error. If a process is missing, JAX declares it dead within the heartbeat
    timeout and terminates this process itself; the supervisor then names it. If the library cannot tell,
    this waits up to `wait` seconds, which leaves JAX's failure detection the time to act, then returns.
    """
    if not jax.distributed.is_initialized():
        return
    start = time.monotonic()
    stopped = dead_peers(timeout=wait)
    if stopped is None:
        time.sleep(max(0.0, wait - (time.monotonic() - start)))
        stopped = dead_peers()  # did the coordinator go meanwhile?
    if stopped:
        stop(link, PEER_STOPPED_EXIT_CODE, stopped_message(stopped, phase))
    if stopped == []:
        say_line(f"[process {jax.process_index()}] {phase} failed, and all {jax.process_count()} processes are "
                 "alive: this is not a stopped process")


class Watchdog:
    """Exits the process (status 3) when the current phase runs longer than `timeout` seconds.

    A daemon thread; the main thread blocks in XLA with the GIL released, so the check still runs when a
    collective waits forever for a dead peer. `arm` also reports the phase to the supervisor.
    """

    def __init__(self, timeout: float, link: SupervisorLink):
        self.timeout = timeout
        self._link = link
        self._deadline: float | None = None
        self._what = ""
        self._lock = threading.Lock()
        if timeout > 0:
            threading.Thread(target=self._run, name="watchdog", daemon=True).start()

    def arm(self, what: str) -> None:
        self._link.send("phase", what)
        with self._lock:
            self._what, self._deadline = what, time.monotonic() + self.timeout

    def disarm(self) -> None:
        with self._lock:
            self._deadline = None

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            with self._lock:
                expired = self._deadline is not None and time.monotonic() > self._deadline
                what = self._what
            if expired:
                stopped = dead_peers() if jax.distributed.is_initialized() else None
                if stopped:
                    stop(self._link, PEER_STOPPED_EXIT_CODE, stopped_message(stopped, what))
                stop(self._link, 3, f"{what} did not finish within {self.timeout:g} s (another process may "
                     "have died); exiting")

    @contextlib.contextmanager
    def phase(self, what: str, wait_on_failure: float = 0.0):
        """Arms the watchdog for `what`. When `what` fails in a multi-process job, first checks whether
        another process stopped (`stop_if_a_process_stopped`, waiting up to `wait_on_failure` s)."""
        self.arm(what)
        try:
            yield
        except Exception:
            stop_if_a_process_stopped(self._link, what, wait_on_failure)
            raise
        finally:
            self.disarm()


# ----------------------------------------------------------------------------------------------------------
# Data, model, step
# ----------------------------------------------------------------------------------------------------------
def global_data(args: argparse.Namespace, num_devices: int) -> tuple[np.ndarray, np.ndarray]:
    """The global (x, target), each [batch_per_device * num_devices, num_tokens, model_dim], from `--seed`."""
    rng = np.random.default_rng(args.seed)
    shape = (args.batch_per_device * num_devices, args.num_tokens, args.model_dim)
    x = rng.standard_normal(shape, dtype=np.float32)
    # a learnable target: a fixed random non-linear map of x
    mix = rng.standard_normal((args.model_dim, args.model_dim), dtype=np.float32) / np.float32(math.sqrt(args.model_dim))
    target = np.tanh(x @ mix).astype(np.float32)
    return x, target


def put_global(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from the same numpy value on every process; each process fills only its own shards."""
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def make_model(args: argparse.Namespace, world_size: int):
    """(config, params): params = {'proj': [M, M], 'moe': tutel_jax layer params with E = count * W}."""
    gate_type = {"type": "top", "k": args.top, "capacity_factor": args.capacity_factor}
    experts = {"type": "ffn", "count_per_node": args.count_per_node, "hidden_size_per_expert": args.hidden_size,
               "activation_fn": jax.nn.relu}
    config = make_config(gate_type, args.model_dim, experts, world_size=world_size)
    proj_key, moe_key = jax.random.split(jax.random.key(args.seed))
    proj = jax.random.normal(proj_key, (args.model_dim, args.model_dim), jnp.float32) / math.sqrt(args.model_dim)
    return config, {"proj": proj, "moe": init_params(config, moe_key)}


def place_params(params: dict, placement: ExpertParallel) -> dict:
    """The projection replicated, the MoE layer through `shard_params` (experts split over all devices)."""
    return {"proj": jax.device_put(params["proj"], NamedSharding(placement.mesh, P())),
            "moe": shard_params(params["moe"], placement)}


def make_train_step(config, placement: ExpertParallel, optimizer: optax.GradientTransformation,
                    args: argparse.Namespace):
    top_k, capacity_factor, l_aux_wt = args.top, args.capacity_factor, args.l_aux_wt

    def loss_fn(params, x, target):
        h = jnp.einsum("btm,mn->btn", x, params["proj"])
        y, aux = moe_apply_parallel(params["moe"], h, config, placement, top_k=top_k,
                                    capacity_factor=capacity_factor)
        loss = jnp.mean(jnp.square(y - target))
        if l_aux_wt:
            loss = loss + l_aux_wt * aux.l_aux
        return loss, aux

    def step(params, opt_state, x, target):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, target)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, aux.dropped_fraction

    return jax.jit(step, donate_argnums=(0, 1))


def make_optimizer(args: argparse.Namespace) -> optax.GradientTransformation:
    return optax.adam(args.lr) if args.optimizer == "adam" else optax.sgd(args.lr)


def init_optimizer(optimizer: optax.GradientTransformation, params: dict, mesh: Mesh):
    """The optimizer state with the shardings the train step returns it with (else step 1 compiles again).

    Run eagerly, `zeros_like` keeps each parameter's sharding for its moments (under `jit` they would come
    out replicated, as they do not depend on the parameters' values); leaves unrelated to the parameters
    (Adam's step count) land on one local device and are replicated over the mesh here.
    """
    state = optimizer.init(params)
    replicated = NamedSharding(mesh, P())
    mesh_devices = set(mesh.devices.flat)

    def on_mesh(leaf):
        if isinstance(leaf, jax.Array) and leaf.sharding.device_set != mesh_devices:
            return jax.device_put(np.asarray(leaf), replicated)  # same value on every process
        return leaf

    return jax.tree.map(on_mesh, state)


# ----------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------
def main(args: argparse.Namespace) -> list[float]:
    link = SupervisorLink(os.environ.pop(SUPERVISOR_ENV, None))
    initialize_distributed(args)
    watchdog = Watchdog(args.step_timeout, link)
    pid, nproc = jax.process_index(), jax.process_count()
    if jax.distributed.is_initialized():
        link.send("process", pid)
        link.send("coordinator", current_coordinator_address() or args.coordinator_address or "")
    # after a failed step: how long to wait for JAX to declare a stopped process dead (see the docstring)
    failure_wait = args.heartbeat_timeout + 5.0

    devices = jax.devices()  # all processes' devices, ordered by process then local id
    mesh = Mesh(np.array(devices), ("expert",))
    placement = ExpertParallel(mesh, expert_axes=("expert",))
    world_size = placement.world_size
    try:
        config, params = make_model(args, world_size)
    except ValueError as err:
        build_parser().error(str(err))

    tokens_sharding = NamedSharding(mesh, P("expert"))
    x_np, target_np = global_data(args, world_size)
    with watchdog.phase("start-up (parameter placement across processes)", failure_wait):
        x, target = put_global(x_np, tokens_sharding), put_global(target_np, tokens_sharding)
        params = place_params(params, placement)
        optimizer = make_optimizer(args)
        opt_state = init_optimizer(optimizer, params, mesh)
        train_step = make_train_step(config, placement, optimizer, args)

    print(f"[process {pid}/{nproc}] devices: {jax.local_device_count()} local, {world_size} global "
          f"({devices[0].platform}); experts: {config.num_global_experts} ({args.count_per_node} per device); "
          f"global batch {x.shape[0]} x {args.num_tokens} tokens, model_dim {args.model_dim}, "
          f"top-{args.top}, capacity_factor {args.capacity_factor:g}, {args.optimizer}(lr={args.lr:g})", flush=True)

    losses = []
    for i in range(args.num_steps):
        if args.fail_at_step is not None and i == args.fail_at_step:
            link.send("exit", 1)
            say_line(f"[process {pid}] --fail_at_step {i}: exiting abruptly")
            os._exit(1)
        t0 = time.perf_counter()
        with watchdog.phase(f"step {i}", failure_wait):
            params, opt_state, loss, dropped = train_step(params, opt_state, x, target)
            loss = float(loss)  # replicated: every process reads its own copy
            dropped = float(dropped)
        losses.append(loss)
        print(f"step {i} loss {loss:.9g}  (dropped {dropped:.3f}, {time.perf_counter() - t0:.3f} s)", flush=True)

    if jax.distributed.is_initialized():
        with watchdog.phase("shutdown", failure_wait):
            jax.distributed.shutdown()  # barrier: waits for every process to finish
    print(f"[process {pid}] done", flush=True)
    return losses


if __name__ == "__main__":
    main(ARGS)
