#!/usr/bin/env python3
"""Train a Qwen3-MoE-style byte-level language model on the Python standard library's source files.

    python examples/train_lm.py                       # 8 CPU devices, MoE (8 experts, top-2) in every layer
    python examples/train_lm.py --dense               # the dense baseline (same active parameters per token)
    python examples/train_lm.py --steps 400 --ckpt-dir ckpt --ckpt-every 100     # ... later: --resume
    python examples/train_lm.py --switch-at 200 --switch-to ep=4,dp=2,d=2        # change layout mid-run
    python examples/train_lm.py --autotune "ep=8; ep=8,d=2; node=2,local=4; ep=4,dp=2"
    python examples/train_lm.py --num-processes 2     # 2 processes x 4 devices on 127.0.0.1 (jax.distributed)
    python examples/train_lm.py --export out/lm       # then: tutel-jax generate out/lm ... / tutel-jax serve out/lm

Model: `tutel_jax.lm.LMSize` (RMSNorm, RoPE, GQA with q/k norms, a tutel-jax MoE FFN in every layer: the
Qwen3-MoE router, SwiGLU experts), its parameters laid out as an HF `qwen3_moe` checkpoint, so `--export`
writes one that `from_pretrained` and HF transformers load. Data: `tutel_jax.lm.ByteCorpus` (bytes, split by
file path; batch i depends only on (seed, i), so a resumed run sees the same batches). Training: optax AdamW
with linear warmup + cosine decay and global-norm clipping, `tutel_jax.training._trainer.MoETrainer` over a mesh of all
devices (tokens split over every device, experts over the 'expert' axis). The progress bar shows the loss,
tokens/s and each MoE layer's dropped fraction; `--log` writes one JSON object per line (steps, evaluations,
expert load per layer, switches, the autotune decisions).

Bit-exact resume: checkpoints (Orbax, written atomically) hold params, optimizer state and the step; batch i
and the gate noise of step i depend only on i, and the resumed run compiles the same program, so its losses
equal those of an uninterrupted run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

if __package__ in (None, ""):  # run as a script: make `tutel_jax` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tutel_jax.layer import execution  # noqa: E402
from tutel_jax.parallel import dump_stacks_on_signal, free_port, run_processes  # noqa: E402
from tutel_jax.cli_args import finite_float, int_at_least, positive_float, set_host_device_count  # noqa: E402

DEFAULT_DEVICES = 8
DEFAULT_AUTOTUNE = "ep=8; ep=8,d=2; node=2,local=4; ep=8,r=0; ep=4,dp=2"
#: the execution knobs training applies: the kernels (runtime level), and the layout switches of the runtime
RUNTIME_KNOBS = ("dropless_impl", "a2a_ffn_overlap_degree", "use_2dh", "adaptive_r")
TRAIN_KNOBS = ("kernel_backend", *RUNTIME_KNOBS)


# ----------------------------------------------------------------------------------------------------------
# arguments
# ----------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="train_lm.py", description=__doc__.split("\n\n")[0])
    m = p.add_argument_group("model")
    m.add_argument("--hidden", type=int_at_least(1), default=192)
    m.add_argument("--layers", type=int_at_least(1), default=4)
    m.add_argument("--heads", type=int_at_least(1), default=6)
    m.add_argument("--kv-heads", type=int_at_least(1), default=2)
    m.add_argument("--head-dim", type=int_at_least(1), default=32)
    m.add_argument("--experts", type=int_at_least(1), default=8)
    m.add_argument("--top-k", type=int_at_least(1), default=2)
    m.add_argument("--expert-hidden", type=int_at_least(1), default=384, help="each expert's intermediate width")
    m.add_argument("--dense", action="store_true",
                   help="the dense baseline: FFN width top_k x expert_hidden (same active parameters)")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int_at_least(1), default=600)
    t.add_argument("--batch", type=int_at_least(1), default=32, help="global batch (sequences)")
    t.add_argument("--seq", type=int_at_least(2), default=256, help="tokens (bytes) per sequence")
    t.add_argument("--lr", type=positive_float, default=3e-3, help="peak learning rate")
    t.add_argument("--warmup", type=int_at_least(0), default=50)
    t.add_argument("--min-lr-ratio", type=finite_float, default=0.1, help="final lr / peak lr of the cosine")
    t.add_argument("--weight-decay", type=finite_float, default=0.1)
    t.add_argument("--clip", type=positive_float, default=1.0, help="global gradient-norm clip")
    t.add_argument("--capacity-factor", type=finite_float, default=1.25,
                   help="Tutel's cf for training (> 0 fixed capacity, 0 dropless, < 0 bounded dropless)")
    t.add_argument("--aux-weight", type=finite_float, default=None,
                   help="load-balancing loss weight (default: the config's router_aux_loss_coef)")
    t.add_argument("--runtime", type=str, default=None,
                   help="layout, e.g. ep=8 (default) or ep=4,dp=2,d=2 (see tutel_jax.runtime._text); dense: dp=N")
    t.add_argument("--seed", type=int, default=0, help="seed of the parameters, the batches and the gate noise")
    d = p.add_argument_group("data")
    d.add_argument("--corpus", type=Path, default=None, help="root folder of the source files (default: stdlib)")
    d.add_argument("--max-corpus-bytes", type=int_at_least(1), default=None, help="use only the first N bytes")
    d.add_argument("--val-fraction", type=finite_float, default=0.05)
    d.add_argument("--eval-every", type=int_at_least(1), default=100)
    d.add_argument("--eval-batches", type=int_at_least(1), default=8)
    c = p.add_argument_group("checkpoints, switching, output")
    c.add_argument("--ckpt-dir", type=Path, default=None)
    c.add_argument("--ckpt-every", type=int_at_least(1), default=100)
    c.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    c.add_argument("--stop-at", type=int_at_least(1), default=None,
                   help="stop after this step (the schedule still spans --steps; to test --resume)")
    c.add_argument("--switch-at", type=int_at_least(1), default=None, help="switch the layout before this step")
    c.add_argument("--switch-to", type=str, default="ep=4,dp=2,d=2", help="the layout --switch-at switches to")
    c.add_argument("--autotune", type=str, nargs="?", const=DEFAULT_AUTOTUNE, default=None,
                   help=f"time these ';'-separated layouts on live batches and keep the fastest "
                        f"(default set: {DEFAULT_AUTOTUNE!r})")
    c.add_argument("--log", type=Path, default=None, help="JSON lines: steps, evaluations, switches")
    c.add_argument("--log-every", type=int_at_least(1), default=10)
    c.add_argument("--export", type=Path, default=None, help="write the trained model as an HF checkpoint")
    c.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    mp = p.add_argument_group("processes")
    mp.add_argument("--num-processes", type=int_at_least(1), default=1,
                    help="run N processes on 127.0.0.1 (jax.distributed, gloo), 8 / N devices each")
    mp.add_argument("--process-id", type=int_at_least(0), default=None, help=argparse.SUPPRESS)
    mp.add_argument("--coordinator", type=str, default=None, help=argparse.SUPPRESS)
    mp.add_argument("--devices", type=int_at_least(1), default=DEFAULT_DEVICES,
                    help="CPU devices in all (default 8)")
    mp.add_argument("--timeout", type=positive_float, default=7200.0,
                    help="seconds before the processes of a multi-process run are stopped")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    execution.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        execution.from_arguments(args, allowed=TRAIN_KNOBS)
    except ValueError as e:
        parser.error(str(e))
    if args.devices % args.num_processes:
        parser.error(f"--devices {args.devices} must divide over --num-processes {args.num_processes}")
    if args.resume and args.ckpt_dir is None:
        parser.error("--resume needs --ckpt-dir")
    if not 0.0 < args.val_fraction < 1.0:
        parser.error(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    if args.switch_at is not None and args.switch_at >= args.steps:
        parser.error(f"--switch-at {args.switch_at} must be below --steps {args.steps}")
    return args


# ----------------------------------------------------------------------------------------------------------
# several processes on this machine
# ----------------------------------------------------------------------------------------------------------
def launch(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Runs this script as `--num-processes` children on 127.0.0.1; relays process 0's output.

    Every child is killed after `--timeout` seconds or as soon as one of them fails, so nothing hangs."""
    address = f"127.0.0.1:{free_port()}"
    script = str(Path(__file__).resolve())
    commands = [[sys.executable, script, *argv, "--process-id", str(i), "--coordinator", address]
                for i in range(args.num_processes)]
    results = run_processes(commands, timeout=args.timeout, relay=0, stop_on_failure=True, poll_s=0.2)
    failed = [(i, r) for i, r in enumerate(results) if r.returncode]
    for i, r in failed:
        if i != 0:
            print(f"[process {i}] exited with {r.returncode}:\n{r.output[-4000:]}", file=sys.stderr)
    if failed:
        return failed[0][1].returncode
    if any(r.killed for r in results):
        for i, r in enumerate(results):
            if i != 0:  # process 0's output (its stack dump included) went to this terminal already
                print(f"[process {i}] at the deadline:\n{r.output[-4000:]}", file=sys.stderr)
        print(f"error: the processes did not finish within --timeout {args.timeout:g} s; stopped them",
              file=sys.stderr)
        return 124
    return 0


# ----------------------------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------------------------
def make_optimizer(args: argparse.Namespace):
    """AdamW (no decay on 1-D parameters: norms, biases) with warmup + cosine decay, after global-norm clipping."""
    import jax
    import optax
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(args.warmup, 1), max(args.steps, args.warmup + 1),
                                                  end_value=args.lr * args.min_lr_ratio)
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim > 1, params)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(args.clip),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay, mask=decay_mask))


def layer_config(size: Any, model: Any) -> Any:
    """The MoEConfig the trainer lays out. A dense model has no MoE layer: its MoE sibling's config only sizes the
    mesh then (nothing of the dense model is expert-sharded)."""
    import dataclasses
    from tutel_jax.lm import init_lm, moe_config
    if any(c is not None for c in model.moe_configs):
        return moe_config(model)
    return moe_config(init_lm(dataclasses.replace(size, dense=False, layers=1), seed=0))


class JsonLog:
    """One JSON object per line (process 0 only); appends when resuming."""

    def __init__(self, path: Path | None, enabled: bool, append: bool):
        self._file = None
        if path is not None and enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a" if append else "w")

    def write(self, **entry: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps(entry) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _floats(x: Any) -> Any:
    import numpy as np
    a = np.asarray(x, np.float64)
    return float(a) if a.ndim == 0 else a.round(6).tolist()


class LMRun:
    """One training run, step by step: the corpus, the model, the trainer, the log (see `run` for the loop).

    `benchmarks/train_lm.py` drives two of them (MoE and dense) step by step, interleaved."""

    def __init__(self, args: argparse.Namespace, say=print):
        import jax
        import numpy as np

        from tutel_jax.lm import ByteCorpus, LMSize, init_lm, lm_loss
        from tutel_jax.runtime import RuntimeConfig
        from tutel_jax.runtime import parse_runtime
        from tutel_jax.training import MoETrainer

        self.args, self.say = args, say
        self.main_process = jax.process_index() == 0
        self.size = LMSize(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                           head_dim=args.head_dim, experts=args.experts, top_k=args.top_k,
                           expert_hidden=args.expert_hidden, max_len=max(2048, args.seq), dense=args.dense)
        self.train = ByteCorpus(args.corpus, split="train", val_fraction=args.val_fraction,
                                max_bytes=args.max_corpus_bytes)
        val = ByteCorpus(args.corpus, split="validation", val_fraction=args.val_fraction,
                         max_bytes=None if args.max_corpus_bytes is None else max(args.max_corpus_bytes // 10, 65536))
        num_devices = jax.device_count()
        runtime = parse_runtime(args.runtime) if args.runtime else (
            RuntimeConfig.ep(1, data=num_devices) if args.dense else RuntimeConfig.ep(num_devices))
        if runtime.capacity_factor is None:
            runtime = runtime.replace(capacity_factor=args.capacity_factor)
        knobs = execution.from_arguments(args, allowed=TRAIN_KNOBS).set_fields()  # flags beat --runtime's text
        runtime = runtime.replace(**{k: v for k, v in knobs.items() if k in RUNTIME_KNOBS})
        if runtime.num_devices != num_devices:
            raise ValueError(f"--runtime {runtime.describe()} uses {runtime.num_devices} devices, but there are "
                             f"{num_devices}")
        if args.batch % num_devices:
            raise ValueError(f"--batch {args.batch} does not divide over the {num_devices} devices of the mesh")
        self.eval_sets = val.eval_batches(args.batch, args.seq, args.eval_batches)
        self.model = init_lm(self.size, seed=args.seed)
        model = self.model

        def loss_fn(p, batch, moe):
            return lm_loss(p, batch, moe, model=model, aux_weight=args.aux_weight)

        params = jax.tree.map(np.asarray, model.params)  # host arrays: the trainer places them on the global mesh
        self.trainer = MoETrainer(layer_config(self.size, model), loss_fn, make_optimizer(args), params, runtime,
                                  seed=args.seed)
        self.step = 0
        if args.resume:
            from tutel_jax.training import latest_step
            if latest_step(args.ckpt_dir) is None:
                raise ValueError(f"--resume: no checkpoint in {args.ckpt_dir}")
            self.step = self.trainer.restore(args.ckpt_dir)
        self.log = JsonLog(args.log, self.main_process, append=args.resume)
        if self.step == 0:
            self.log.write(event="start", size=vars_of(self.size), runtime=runtime.describe(),
                           args=_jsonable(vars(args)), train_bytes=self.train.num_bytes, val_bytes=val.num_bytes,
                           devices=num_devices, processes=jax.process_count(),
                           total_params=self.size.total_params(), active_params=self.size.active_params())
        self.summary: dict[str, Any] = {"losses": {}, "evals": [], "switches": [], "autotune": [],
                                        "tokens_per_s": []}
        self.stop = min(args.steps, args.stop_at or args.steps)
        self._batches = None
        if args.autotune:  # every candidate is checked now, before any step (even if tuning never starts)
            for text in (t for t in args.autotune.split(";") if t.strip()):
                try:
                    self.trainer.plan(parse_runtime(text))
                except ValueError as e:
                    raise ValueError(f"--autotune candidate {text.strip()!r}: {e}") from None

    @property
    def done(self) -> bool:
        return self.step >= self.stop

    def global_batch(self, step: int) -> dict[str, Any]:
        """Batch `step`: {'tokens': int32 [B, T + 1]}, the same on every process."""
        return {"tokens": self.train.batch(step, self.args.batch, self.args.seq, seed=self.args.seed)}

    def evaluate(self) -> dict[str, float]:
        """Mean validation cross entropy over the fixed validation batches (nats and bits per byte)."""
        import numpy as np
        from tutel_jax.lm import bits_per_byte
        ce = float(np.mean([float(self.trainer.evaluate({"tokens": b})["ce"]) for b in self.eval_sets]))
        entry = {"step": self.step, "val_ce": ce, "val_bpb": bits_per_byte(ce)}
        self.summary["evals"].append(entry)
        self.log.write(event="eval", **entry)
        self.say(f"step {self.step}: validation {entry['val_bpb']:.4f} bits/byte")
        return entry

    def _close_batches(self) -> None:
        if self._batches is not None:
            self._batches.close()
            self._batches = None

    def maybe_autotune(self) -> None:
        if self.args.autotune and self.stop - self.step >= tuning_steps(self.args):
            self.step = autotune(self.trainer, self.args, self.global_batch, self.log, self.summary, self.say)

    def train_step(self) -> dict[str, Any]:
        """One step (switching first at --switch-at); logs, checkpoints and evaluates on schedule."""
        import numpy as np
        from tutel_jax.runtime import parse_runtime
        args, trainer = self.args, self.trainer
        if args.switch_at is not None and self.step == args.switch_at:
            target = parse_runtime(args.switch_to)
            if target.capacity_factor is None:
                target = target.replace(capacity_factor=trainer.runtime.capacity_factor)
            report = trainer.switch(target)
            entry = {"step": self.step, "from": report.previous.describe(), "to": report.current.describe(),
                     "reshard_s": report.reshard_s}
            self.summary["switches"].append(entry)
            self.log.write(event="switch", **entry)
            self.say(f"step {self.step}: switched {entry['from']} -> {entry['to']} ({report.reshard_s * 1e3:.1f} ms)")
        if self._batches is None:  # prefetching from the current step on
            self._batches = self.train.batches(args.batch, args.seq, seed=args.seed, start_step=self.step)
        got, tokens = next(self._batches)
        if got != self.step:
            raise RuntimeError(f"data loader at step {got}, training at step {self.step}")
        t0 = time.perf_counter()
        metrics = trainer.step({"tokens": tokens})
        loss = float(metrics["loss"])  # waits for the step
        seconds = time.perf_counter() - t0
        self.step += 1
        step = self.step
        if not math.isfinite(loss):
            raise FloatingPointError(f"step {step}: the loss is {loss}; stopping")
        self.summary["losses"][step] = loss
        # re-tune when the routing left the capacity band, if the tuning steps still fit before --steps
        if args.autotune and trainer.observe_routing(metrics) and self.stop - self.step >= tuning_steps(args):
            self._close_batches()  # the re-tuning steps take the next batches; prefetching restarts after them
            self.step = autotune(trainer, args, self.global_batch, self.log, self.summary, self.say)
            step = self.step
        rate = args.batch * args.seq / seconds
        self.summary["tokens_per_s"].append(rate)
        dropped = np.atleast_1d(np.asarray(metrics["dropped"], np.float64)).tolist() if "dropped" in metrics else []
        entry = {"step": step, "loss": loss, "ce": _floats(metrics["ce"]), "l_aux": _floats(metrics["l_aux"]),
                 "dropped": [round(d, 6) for d in dropped], "tokens_per_s": rate,
                 "runtime": trainer.runtime.describe()}
        if step % args.log_every == 0 or step == self.stop:
            if "load" in metrics:
                entry["load"] = _floats(metrics["load"])
            self.log.write(event="step", **entry)
        if args.ckpt_dir is not None and (step % args.ckpt_every == 0 or step == self.stop):
            from tutel_jax.training import all_steps
            if step not in all_steps(args.ckpt_dir):
                trainer.save(args.ckpt_dir, max_to_keep=3)
        if step % args.eval_every == 0 or step == self.stop:
            self.evaluate()
        return entry

    def finish(self) -> dict[str, Any]:
        """Exports (--export), closes the log; returns the summary."""
        import jax
        import numpy as np
        from tutel_jax.lm import export_lm
        self._close_batches()
        if self.args.export is not None:
            from jax.experimental import multihost_utils
            params = self.trainer.state.params
            host = (multihost_utils.process_allgather(params, tiled=True) if jax.process_count() > 1
                    else jax.tree.map(np.asarray, params))
            if self.main_process:
                export_lm(self.model, host, self.args.export)
                self.say(f"exported the model to {self.args.export}")
            self.summary["export"] = str(self.args.export)
        rates = self.summary["tokens_per_s"]
        steady = rates[min(5, len(rates) - 1):] if rates else []  # the first steps include compilation
        self.summary["median_tokens_per_s"] = float(np.median(steady)) if steady else None
        self.log.write(event="end", step=self.step, median_tokens_per_s=self.summary["median_tokens_per_s"])
        self.log.close()
        return self.summary


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Trains (single or multi-process) with a progress bar; returns the summary (losses, evaluations, ...)."""
    import jax
    bar = None
    if jax.process_index() == 0 and not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=min(args.steps, args.stop_at or args.steps), unit="step", dynamic_ncols=True)

    def say(text: str) -> None:
        if jax.process_index() == 0:
            if bar is None:
                print(text, flush=True)
            else:
                bar.write(text)

    lm = LMRun(args, say)
    try:
        if bar is not None:
            bar.update(lm.step)
        lm.maybe_autotune()
        if bar is not None:
            bar.update(lm.step - bar.n)
        while not lm.done:
            entry = lm.train_step()
            drops = "/".join(f"{d:.2f}" for d in entry["dropped"]) or "-"
            if bar is not None:
                bar.set_postfix_str(f"loss {entry['loss']:.3f} tok/s {entry['tokens_per_s']:,.0f} drop {drops}",
                                    refresh=False)
                bar.update(1)
            elif entry["step"] % args.log_every == 0 or lm.done:
                say(f"step {entry['step']} loss {entry['loss']:.4f} tok/s {entry['tokens_per_s']:,.0f} "
                    f"dropped {drops}")
    finally:
        if bar is not None:
            bar.close()
    return lm.finish()


AUTOTUNE_WARMUP, AUTOTUNE_MEASURE = 1, 3  # steps per candidate: untimed, then timed


def tuning_steps(args: argparse.Namespace) -> int:
    """Training steps one autotune takes: (warmup + measured) steps per candidate."""
    return len([t for t in args.autotune.split(";") if t.strip()]) * (AUTOTUNE_WARMUP + AUTOTUNE_MEASURE)


def autotune(trainer: Any, args: argparse.Namespace, global_batch, log: JsonLog, summary: dict[str, Any],
             say) -> int:
    """Times the --autotune layouts on live batches (real training steps) and keeps the fastest; returns the step
    reached (the tuning steps count as training steps). Called again when the routing leaves the capacity band
    the choice was made for (`MoETrainer.observe_routing`)."""
    from tutel_jax.runtime import parse_runtime
    cf = trainer.runtime.capacity_factor
    candidates = [parse_runtime(text) for text in args.autotune.split(";") if text.strip()]
    candidates = [c if c.capacity_factor is not None else c.replace(capacity_factor=cf) for c in candidates]

    def live() -> Iterator[dict[str, Any]]:
        s = int(trainer.state.step)
        while True:
            yield global_batch(s)
            s += 1

    seen = len(trainer.autotune_log.entries)
    report = trainer.autotune(candidates, batches=live(), warmup=AUTOTUNE_WARMUP, measure=AUTOTUNE_MEASURE)
    for entry in trainer.autotune_log.entries[seen:]:
        log.write(event="autotune", decision=_jsonable(entry.as_dict()))
    summary["autotune"].append(_jsonable(report.as_dict()))
    say(f"autotune: chose {trainer.runtime.describe()}")
    return int(trainer.state.step)


def vars_of(obj: Any) -> dict[str, Any]:
    import dataclasses
    return dataclasses.asdict(obj)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.num_processes > 1 and args.process_id is None:
        return launch(args, argv)
    # before the first device use (the CPU backend reads it then)
    set_host_device_count(args.devices // args.num_processes)
    import jax
    if args.num_processes > 1:
        dump_stacks_on_signal()  # the launcher's deadline shows where a hung process waited
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id, initialization_timeout=120)
    try:
        with execution.use_kernels(execution.from_arguments(args).kernel_backend):  # the runtime level
            run(args)
    except (ValueError, FloatingPointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
