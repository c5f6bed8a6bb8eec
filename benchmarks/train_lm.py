"""Does MoE beat dense? The byte-level LM of `examples/train_lm.py` trained twice, side by side in one run.

    python benchmarks/train_lm.py [--steps 400] [--quick] [--out benchmarks/results/train_lm_cpu.json]
        [any train_lm.py option, e.g. --hidden 192 --batch 16 --seq 128]

Both runs get the same data (batch i is the same for both), steps, schedule, optimizer and seed: the MoE model
(E experts, top-k, a tutel-jax MoE FFN in every layer, expert + data parallel over the 8 CPU devices) and the
dense baseline with the same active parameters per token (FFN width k x expert width; data parallel). Their steps
are interleaved (MoE step, dense step, ...), so a slow drift of the machine hits both alike; both evaluate on the
same fixed validation batches (files the training split never saw) every --eval-every steps.

Writes `<out>.json`, `<out>.md` (the README table: steps, tokens, final validation bits per byte, tokens/s),
`train_lm_loss.png` (both validation curves) and `train_lm_expert_load.png` (each MoE layer's expert load over
training) next to it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import fmt_ratio, machine_info, markdown_table, repo_root, write_json, write_text  # noqa: E402
from tutel_jax.cli_args import set_host_device_count  # noqa: E402

DEFAULT_OUT = repo_root() / "benchmarks/results/train_lm_cpu.json"
QUICK = ["--steps", "6", "--hidden", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
         "--experts", "8", "--expert-hidden", "32", "--batch", "8", "--seq", "32", "--max-corpus-bytes", "200000",
         "--eval-every", "3", "--eval-batches", "2", "--log-every", "1", "--warmup", "2"]
DEFAULTS = ["--steps", "400", "--batch", "16", "--seq", "128", "--eval-every", "40", "--eval-batches", "8",
            "--log-every", "10", "--warmup", "40", "--capacity-factor", "2.0"]


def load_train_lm():
    """examples/train_lm.py as a module."""
    import importlib.util
    path = repo_root() / "examples" / "train_lm.py"
    spec = importlib.util.spec_from_file_location("train_lm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plot(result: dict[str, Any], loss_png: Path, load_png: Path) -> None:
    """Both validation curves in one figure; each MoE layer's expert load (fraction of assignments) over steps."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, run in result["runs"].items():
        steps = [e["step"] for e in run["evals"]]
        ax.plot(steps, [e["val_bpb"] for e in run["evals"]], marker="o", ms=3,
                label=f"{name} ({run['active_params'] / 1e6:.2f}M active / {run['total_params'] / 1e6:.2f}M total)")
    ax.set_xlabel("step")
    ax.set_ylabel("validation bits per byte")
    ax.set_title("Byte-level LM on the Python standard library: MoE vs dense")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(loss_png, dpi=120)
    plt.close(fig)

    loads = result["runs"]["moe"]["load"]
    steps = [e["step"] for e in loads]
    per_layer = np.asarray([e["load"] for e in loads])  # [steps, L, E]
    layers, experts = per_layer.shape[1], per_layer.shape[2]
    fig, axes = plt.subplots(1, layers, figsize=(3.2 * layers, 3.2), sharey=True, squeeze=False)
    for i, ax in enumerate(axes[0]):
        ax.stackplot(steps, per_layer[:, i, :].T, labels=[f"expert {e}" for e in range(experts)])
        ax.axhline(0.5, color="k", lw=0.5, alpha=0.3)
        ax.set_title(f"MoE layer {i}")
        ax.set_xlabel("step")
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("share of routed assignments")
    axes[0][-1].legend(fontsize=6, loc="upper right", ncol=2)
    fig.suptitle("Expert load per layer over training (balanced = equal bands)")
    fig.tight_layout()
    fig.savefig(load_png, dpi=120)
    plt.close(fig)


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    s = result["settings"]
    moe, dense = result["runs"]["moe"], result["runs"]["dense"]
    rows = []
    for name, run in result["runs"].items():
        rows.append([name, f"{run['active_params'] / 1e6:.2f}M / {run['total_params'] / 1e6:.2f}M", run["steps"],
                     f"{run['tokens'] / 1e6:.2f}M", f"**{run['final_val_bpb']:.4f}**",
                     f"{run['best_val_bpb']:.4f}", f"{run['median_tokens_per_s']:,.0f}"])
    verdict = ("lower" if moe["final_val_bpb"] < dense["final_val_bpb"] else "NOT lower")
    lines = [
        f"Measured on {m['backend']} ({m['cpu_count']} CPUs, {m['device_count']} devices), jax {m['jax_version']}, "
        f"{m['date']}{' (quick smoke run)' if result['quick'] else ''}. Byte-level Qwen3-MoE-style LM "
        f"(hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads / {s['kv_heads']} KV heads); MoE: "
        f"{s['experts']} experts, top-{s['top_k']}, expert width {s['expert_hidden']}, cf {s['capacity_factor']}; "
        f"dense: FFN width {s['top_k'] * s['expert_hidden']}. Batch {s['batch']} x {s['seq']} bytes, AdamW "
        f"(peak lr {s['lr']}, warmup {s['warmup']}, cosine), same batches for both, steps interleaved. Corpus: the "
        f"Python standard library's `.py` files ({result['train_bytes'] / 1e6:.1f} MB train, "
        f"validation: {result['val_bytes']:,} bytes of fixed windows from the held-out files; split by file path).",
        "",
        markdown_table(["model", "active / total params", "steps", "tokens", "final val bits/byte",
                        "best val bits/byte", "tokens/s"], rows, "lrrrrrr"),
        f"MoE's final validation loss is {verdict} than dense's at equal steps "
        f"({moe['final_val_bpb']:.4f} vs {dense['final_val_bpb']:.4f} bits/byte); MoE tokens/s / dense tokens/s = "
        f"{fmt_ratio(moe['median_tokens_per_s'] / dense['median_tokens_per_s'])}. Largest per-layer dropped "
        f"fraction in the last logged MoE step: {max(moe['last_dropped'] or [0.0]):.3f}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, a few steps (smoke test)")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON output (default {DEFAULT_OUT})")
    own, rest = parser.parse_known_args(argv)
    set_host_device_count(8)
    train_lm = load_train_lm()
    base = train_lm.parse_args((QUICK if own.quick else DEFAULTS) + rest + ["--no-progress"])
    if base.dense or base.num_processes != 1 or base.autotune or base.resume:
        parser.error("benchmarks/train_lm.py runs one process, MoE against dense, without --autotune / --resume")
    out = own.out or (DEFAULT_OUT.with_name("train_lm_cpu_quick.json") if own.quick else DEFAULT_OUT)
    runs = {"moe": train_lm.LMRun(argparse.Namespace(**{**vars(base), "dense": False}), print),
            "dense": train_lm.LMRun(argparse.Namespace(**{**vars(base), "dense": True}), print)}
    loads, last_dropped = [], []
    for name, run in runs.items():
        run.say = lambda text, name=name: print(f"[{name}] {text}", flush=True)
        run.evaluate()  # step 0: both start from their initialisation
    while not all(run.done for run in runs.values()):
        for name, run in runs.items():
            if not run.done:
                entry = run.train_step()
                if name == "moe" and (entry["step"] % base.log_every == 0 or run.done):
                    loads.append({"step": entry["step"], "load": entry.get("load")})
                    last_dropped = entry["dropped"]
                if entry["step"] % base.log_every == 0:
                    print(f"[{name}] step {entry['step']} loss {entry['loss']:.4f} "
                          f"tok/s {entry['tokens_per_s']:,.0f}", flush=True)
    result: dict[str, Any] = {"benchmark": "train_lm", "quick": own.quick, "machine": machine_info(),
                              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(base).items()},
                              "train_bytes": runs["moe"].train.num_bytes,
                              "val_bytes": int(sum(b.size for b in runs["moe"].eval_sets)), "runs": {}}
    for name, run in runs.items():
        summary = run.finish()
        evals = summary["evals"]
        result["runs"][name] = {
            "steps": run.step, "tokens": run.step * base.batch * base.seq,
            "active_params": run.size.active_params(), "total_params": run.size.total_params(),
            "evals": evals, "final_val_bpb": evals[-1]["val_bpb"], "best_val_bpb": min(e["val_bpb"] for e in evals),
            "losses": summary["losses"], "median_tokens_per_s": summary["median_tokens_per_s"],
        }
    result["runs"]["moe"]["load"] = [e for e in loads if e["load"] is not None]
    result["runs"]["moe"]["last_dropped"] = last_dropped
    write_json(out, result)
    write_text(out.with_suffix(".md"), markdown(result))
    stem = out.stem.replace("_cpu", "")
    plot(result, out.with_name(f"{stem}_loss.png"), out.with_name(f"{stem}_expert_load.png"))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
