#!/usr/bin/env python3
"""Hello-world MoE training benchmark: a JAX port of Tutel's `examples/helloworld.py`.

The model is one MoE layer (Tutel's `top` gate + `ffn` experts with relu) followed by
`log_softmax(sum(moe(x), axis=2), axis=1)`; the loss is the NLL of class 0 (Tutel's `y` is all zeros),
plus `l_aux_wt * l_aux` when `--l_aux_wt` is non-zero. The same random `x` (seed `--seed`, default 0) is
used at every step, and every step prints Tutel's line::

    STEP-<i>: loss = <loss>, step_time = <sec> sec, perf = <tflops> tflops.

Parallelism: plain data parallelism over ALL local devices (on CPU, one device per core: this script sets
`--xla_force_host_platform_device_count` before JAX is imported unless XLA_FLAGS already sets it). Each device
holds `--batch_size` samples, like one Tutel rank, and routes its own tokens exactly as a Tutel rank does
(`jax.shard_map` over the mesh axis 'data'); the gate and the experts are replicated and the gradients are
averaged with `jax.lax.pmean`. Expert parallelism (experts sharded over devices, all_to_all dispatch) is a
separate feature: here the number of experts is E = `--num_local_experts` on every device, and
`--a2a_ffn_overlap_degree`, `--parallel_type` and `--use_2dh` are only passed through to the layer config.

Differences from Tutel's script:
  * Defaults are small (batch 8 x 128 tokens per device, model_dim 256, hidden 1024, 4 experts, top-2,
    20 steps) so that a bare `python examples/helloworld.py` finishes in seconds on a laptop CPU.
  * The optimizer is SGD with `--lr` (default 3e-4). Tutel uses lr = 1e-5, with which the loss barely moves;
    pass `--lr 1e-5` to reproduce that.
  * Each device gets its own slice of one global `x` of shape [batch_size * n_devices, num_tokens, model_dim]
    (Tutel's ranks all see the same x), and one replicated model (Tutel seeds the experts of rank r with
    r + 1; here all devices share the seeds (1, 1), i.e. rank 0's).
  * The loss (log_softmax + NLL) is computed in at least float32 even for 16-bit `--dtype`.
  * The perf figure uses the global token count (all devices); the summary averages the last
    min(10, num_steps) steps.
  * `--checkpoint_path DIR` uses orbax (params + optimizer state + step counter) instead of `torch.save`;
    a resumed run numbers its steps from the restored step (STEP-<restored step>, ...).
  * `--plot PATH` writes a bar chart of the per-expert load (dispatch counts of the last step, per device).

Example::

    python examples/helloworld.py --batch_size 16 --num_tokens 512 --num_steps 50 --l_aux_wt 0.01
"""

from __future__ import annotations

import argparse
import os
import functools
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tutel_jax.parallel import shard_map
from tutel_jax.cli_args import ensure_host_device_count, finite_float, int_at_least, positive_float

from tutel_jax import MoEAux, MoEConfig, init_params, make_config, moe_apply

ensure_host_device_count()  # one CPU device per core unless XLA_FLAGS sets a count; before any device use


DTYPES = ("float32", "bfloat16", "float16", "float64")


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The argument parser (Tutel's flag names, plus --lr, --seed and --plot)."""
    parser = argparse.ArgumentParser(
        prog="helloworld.py",
        description="Tutel's hello-world MoE benchmark in JAX (data parallel over all local devices).")
    parser.add_argument("--batch_size", type=int_at_least(1), default=8, help="samples per device (default 8)")
    parser.add_argument("--num_tokens", type=int_at_least(1), default=128, help="tokens per sample (default 128)")
    parser.add_argument("--model_dim", type=int_at_least(1), default=256)
    parser.add_argument("--hidden_size", type=int_at_least(1), default=1024, help="hidden size per expert")
    parser.add_argument("--num_local_experts", type=int_at_least(1), default=4,
                        help="experts (E); expert parallelism is not used by this example")
    parser.add_argument("--top", type=int_at_least(1), default=2, help="k of the top-k gate (clipped to E)")
    parser.add_argument("--capacity_factor", type=finite_float, default=1.0,
                        help="> 0 fixed capacity, 0 dropless, < 0 bounded dropless (Tutel semantics)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--fp32_gate", action="store_true", help="compute the gate in float32")
    parser.add_argument("--num_steps", type=int_at_least(1), default=20)
    parser.add_argument("--l_aux_wt", type=finite_float, default=0.0, help="weight of the load-balancing loss")
    parser.add_argument("--lr", type=positive_float, default=3e-4,
                        help="SGD learning rate (default 3e-4; Tutel's script uses 1e-5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the input x (Tutel: torch.manual_seed(0))")
    parser.add_argument("--eval", action="store_true", help="forward only (no gradients, no update)")
    parser.add_argument("--checkpoint_path", type=str, default="",
                        help="orbax checkpoint directory: restored before training if present, saved after")
    parser.add_argument("--a2a_ffn_overlap_degree", type=int_at_least(1), default=1)
    parser.add_argument("--parallel_type", type=str, default="adaptive:1", help="'adaptive:<r>', 'data' or 'model'")
    parser.add_argument("--use_2dh", action="store_true", help="hierarchical all_to_all (passed to the config)")
    parser.add_argument("--plot", type=str, default="", metavar="PATH",
                        help="write a PNG bar chart of the per-expert load of the last step")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses and validates the command line (bad values exit with status 2 and an `error:` line)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not (args.parallel_type in ("data", "model") or args.parallel_type.startswith("adaptive:")):
        parser.error(f"argument --parallel_type: must be 'adaptive:<r>', 'data' or 'model', got {args.parallel_type!r}")
    return args


# ----------------------------------------------------------------------------------------------------------
# Model, loss and steps
# ----------------------------------------------------------------------------------------------------------
def make_model(args: argparse.Namespace) -> tuple[MoEConfig, dict]:
    """The MoE layer of Tutel's ExampleModel: (static config, parameter pytree).

    Seeds follow Tutel's `seeds=(1, rank + 1, 1)` for rank 0; the model is replicated on all devices.
    Raises ValueError for arguments the layer rejects.
    """
    gate_type = {"type": "top", "k": args.top, "fp32_gate": args.fp32_gate, "capacity_factor": args.capacity_factor}
    experts = {"type": "ffn", "count_per_node": args.num_local_experts, "hidden_size_per_expert": args.hidden_size,
               "activation_fn": jax.nn.relu}
    config = make_config(gate_type, args.model_dim, experts, a2a_ffn_overlap_degree=args.a2a_ffn_overlap_degree,
                         parallel_type=args.parallel_type, use_2dh=args.use_2dh, dtype=jnp.dtype(args.dtype))
    params = init_params(config, seeds=(1, 1))
    return config, params


def loss_fn(params: dict, x: jax.Array, config: MoEConfig, l_aux_wt: float) -> tuple[jax.Array, MoEAux]:
    """Tutel's loss on one device: nll_loss(log_softmax(sum(moe(x), 2), 1), zeros) [+ l_aux_wt * l_aux]."""
    y, aux = moe_apply(params, x, config)
    logits = jnp.sum(y.astype(jnp.promote_types(y.dtype, jnp.float32)), axis=2)  # [B, T]
    log_probs = jax.nn.log_softmax(logits, axis=1)
    loss = -jnp.mean(log_probs[:, 0])  # y = 0 for every sample
    if l_aux_wt:
        loss = loss + l_aux_wt * aux.l_aux.astype(loss.dtype)
    return loss, aux


def _to_varying(tree: Any, axis: str) -> Any:
    """Marks replicated values as per-device so that their gradients stay per-device (no implicit psum)."""
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(tree, axis, to="varying")
    if hasattr(jax.lax, "pvary"):
        return jax.lax.pvary(tree, axis)
    return tree  # old shard_map without replication typing: gradients are per-device already


def train_step(params: dict, opt_state: Any, x: jax.Array, *, config: MoEConfig,
               optimizer: optax.GradientTransformation, l_aux_wt: float):
    """One SGD step on one device's shard (run under `shard_map`): like one Tutel rank + gradient all-reduce.

    Returns (params, opt_state, loss averaged over devices, this device's dispatch_count [1, E],
    this device's capacity [1], dropped fraction averaged over devices).
    """
    local_params = _to_varying(params, "data")
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(local_params, x, config, l_aux_wt)
    grads = jax.lax.pmean(grads, "data")
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return (params, opt_state, jax.lax.pmean(loss, "data"), aux.dispatch_count[None], aux.capacity[None],
            jax.lax.pmean(aux.dropped_fraction, "data"))


def eval_step(params: dict, x: jax.Array, *, config: MoEConfig, l_aux_wt: float):
    """Forward only on one device's shard; same outputs as `train_step` minus params and optimizer state."""
    loss, aux = loss_fn(params, x, config, l_aux_wt)
    return (jax.lax.pmean(loss, "data"), aux.dispatch_count[None], aux.capacity[None],
            jax.lax.pmean(aux.dropped_fraction, "data"))


def make_steps(mesh: Mesh, config: MoEConfig, optimizer: optax.GradientTransformation, l_aux_wt: float):
    """Jitted, data-parallel train and eval steps over the mesh axis 'data'."""
    stats_specs = (P(), P("data"), P("data"), P())
    train = jax.jit(shard_map(
        functools.partial(train_step, config=config, optimizer=optimizer, l_aux_wt=l_aux_wt),
        mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()) + stats_specs), donate_argnums=(0, 1))
    evaluate = jax.jit(shard_map(
        functools.partial(eval_step, config=config, l_aux_wt=l_aux_wt),
        mesh=mesh, in_specs=(P(), P("data")), out_specs=stats_specs))
    return train, evaluate


# ----------------------------------------------------------------------------------------------------------
# Checkpointing and plotting
# ----------------------------------------------------------------------------------------------------------
def _checkpoint_manager(path: str):
    import orbax.checkpoint as ocp
    options = ocp.CheckpointManagerOptions(max_to_keep=1, create=True)
    return ocp.CheckpointManager(os.path.abspath(path), options=options,
                                 item_handlers=ocp.StandardCheckpointHandler())


def _check_shapes(stored: Any, expected: Any) -> None:
    """Raises ValueError naming the first parameter whose stored shape differs from the model's."""
    stored_leaves = dict(jax.tree_util.tree_flatten_with_path(
        stored, is_leaf=lambda v: hasattr(v, "shape"))[0])
    for path, leaf in jax.tree_util.tree_flatten_with_path(expected)[0]:
        name = jax.tree_util.keystr(path)
        if path not in stored_leaves:
            raise ValueError(f"the checkpoint has no parameter {name}")
        have, want = tuple(stored_leaves[path].shape), tuple(leaf.shape)
        if have != want:
            raise ValueError(f"parameter {name} has shape {have} in the checkpoint but {want} in this model "
                             "(were the size flags different when it was saved?)")


def restore_checkpoint(path: str, state: dict) -> dict | None:
    """Restores {'params', 'opt_state', 'step'} from the latest orbax checkpoint in `path`, or None if none.

    Raises ValueError when the stored parameters do not fit the model.
    """
    import orbax.checkpoint as ocp
    manager = _checkpoint_manager(path)
    try:
        step = manager.latest_step()
        if step is None:
            return None
        metadata = manager.item_metadata(step)
        tree = getattr(metadata, "tree", metadata)
        if not isinstance(tree, dict) or "params" not in tree:
            raise ValueError(f"step {step} does not hold a helloworld checkpoint (no 'params')")
        _check_shapes(tree["params"], state["params"])
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        return manager.restore(step, args=ocp.args.StandardRestore(abstract))
    finally:
        manager.close()


def save_checkpoint(path: str, state: dict) -> None:
    """Saves {'params', 'opt_state', 'step'} as step `state['step']` (orbax writes to a tmp dir and renames;
    the previous checkpoint is deleted only after the new one is complete)."""
    import orbax.checkpoint as ocp
    manager = _checkpoint_manager(path)
    try:
        manager.save(int(state["step"]), args=ocp.args.StandardSave(state), force=True)
        manager.wait_until_finished()
    finally:
        manager.close()


def plot_expert_load(path: str, dispatch_count: np.ndarray, capacity: np.ndarray, title: str) -> None:
    """Writes a stacked bar chart of the assignments per expert (one colour per device) to `path` (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    num_devices, num_experts = dispatch_count.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * num_experts + 2.0) + 2.5, 3.5))
    bottom = np.zeros(num_experts)
    for d in range(num_devices):
        ax.bar(np.arange(num_experts), dispatch_count[d], bottom=bottom, label=f"device {d}")
        bottom += dispatch_count[d]
    ax.axhline(float(np.sum(capacity)), color="black", linestyle="--", linewidth=1,
               label="capacity (sum over devices)")
    ax.set_xlabel("expert")
    ax.set_ylabel("assignments (before dropping)")
    ax.set_xticks(np.arange(num_experts))
    ax.set_title(title)
    if num_devices <= 8:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> dict:
    """Runs the benchmark; returns {'losses', 'step_times', 'average_step_time', 'dispatch_count',
    'capacity', 'start_step', 'world_size'}."""
    args = parse_args(argv)
    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)

    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("data",))
    world_size = mesh.size
    replicated = NamedSharding(mesh, P())

    try:
        config, params = make_model(args)
    except ValueError as err:
        build_parser().error(str(err))
    params = jax.device_put(params, replicated)
    optimizer = optax.sgd(args.lr)
    opt_state = jax.device_put(optimizer.init(params), replicated)

    num_experts = config.num_global_experts
    expert_count = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(params["experts"]))
    gate_count = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(params["gates"]))
    print(f"[Statistics] param count for MoE local_experts = {expert_count}, param count for MoE gate = {gate_count}.")

    # One global input, split over the devices along the batch axis (batch_size samples each); same every step.
    global_batch = args.batch_size * world_size
    x = jax.random.normal(jax.random.key(args.seed), (global_batch, args.num_tokens, args.model_dim), jnp.float32)
    x = jax.device_put(x.astype(jnp.dtype(args.dtype)), NamedSharding(mesh, P("data")))

    print("[Benchmark] world_size = %s, dtype = %s, model_dim = %s, hidden_size = %s, samples = %s, "
          "num_local_experts = %s, topK = %s, a2a_ffn_overlap_degree = %s, parallel_type = `%s`, device = `%s`"
          % (world_size, args.dtype, args.model_dim, args.hidden_size, args.batch_size * args.num_tokens,
             args.num_local_experts, args.top, args.a2a_ffn_overlap_degree, args.parallel_type,
             f"{devices[0].platform} x {world_size}"))
    print(f"[Benchmark] global batch = {global_batch} x {args.num_tokens} tokens, optimizer = SGD(lr={args.lr:g}), "
          f"mode = {'eval' if args.eval else 'train'}")

    start_step = 0
    if args.checkpoint_path:
        ckpt_dir = os.path.abspath(args.checkpoint_path)
        state = {"params": params, "opt_state": opt_state, "step": 0}
        try:
            restored = restore_checkpoint(ckpt_dir, state)
        except Exception as err:  # wrong shapes / corrupt directory: stop with a readable message
            message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            print(f"error: cannot restore the checkpoint in `{ckpt_dir}`: {message}", file=sys.stderr)
            raise SystemExit(1) from None
        if restored is None:
            print(f"Checkpoint not loaded: no checkpoint in `{ckpt_dir}`. Will train the model from start.")
        else:
            params, opt_state, start_step = restored["params"], restored["opt_state"], int(restored["step"])
            print(f"Checkpoint restored from `{ckpt_dir}` at step {start_step}.")

    train, evaluate = make_steps(mesh, config, optimizer, args.l_aux_wt)
    mm_coef = 1 if args.eval else 3
    flops = global_batch * args.num_tokens * args.model_dim * args.hidden_size * 4 * mm_coef * min(args.top, num_experts)

    losses: list[float] = []
    step_times: list[float] = []
    dispatch_count = capacity = None
    for i in range(start_step, start_step + args.num_steps):
        t_start = time.perf_counter()
        if args.eval:
            loss, dispatch_count, capacity, dropped = evaluate(params, x)
        else:
            params, opt_state, loss, dispatch_count, capacity, dropped = train(params, opt_state, x)
        loss = float(jax.block_until_ready(loss))
        step_time = time.perf_counter() - t_start
        tflops = flops * 1e-12 / step_time
        print("STEP-%d: loss = %.5f, step_time = %.6f sec, perf = %.2f tflops." % (i, loss, step_time, tflops),
              flush=True)
        losses.append(loss)
        step_times.append(step_time)

    last = step_times[-10:]
    average_time = sum(last) / len(last)
    print(f"\n[Summary] Average synchronized step_time = {average_time} sec (last {len(last)} steps).")
    dispatch_count = np.asarray(dispatch_count)
    capacity = np.asarray(capacity)
    print(f"[Summary] last step: dispatch_count per expert (all devices) = {dispatch_count.sum(axis=0).tolist()}, "
          f"capacity per device = {int(capacity[0])}, dropped fraction = {float(dropped):.4f}")

    if args.checkpoint_path and not args.eval:
        save_checkpoint(ckpt_dir, {"params": params, "opt_state": opt_state, "step": start_step + args.num_steps})
        print(f"Checkpoint saved to `{ckpt_dir}` at step {start_step + args.num_steps}.")

    if args.plot:
        plot_expert_load(args.plot, dispatch_count, capacity,
                         f"expert load, step {start_step + args.num_steps - 1} (top-{args.top}, E={num_experts})")
        print(f"Expert load plot written to `{args.plot}`.")

    return {"losses": losses, "step_times": step_times, "average_step_time": average_time,
            "dispatch_count": dispatch_count, "capacity": capacity, "start_step": start_step,
            "world_size": world_size}


if __name__ == "__main__":
    main()
