"""Command line: Tutel's checkpoint gather / scatter, without torch.

    python -m tutel_jax.checkpoint gather --inputs=/ckpt/moe-{rank}-of-{size}.pt --input_size=8 --output=/ckpt/full.pt
    python -m tutel_jax.checkpoint scatter --input=/ckpt/full.pt --output_size=4 --outputs=/ckpt/moe-{rank}-of-{size}.pt

`gather` merges N per-rank files into one file with all E experts; `scatter` splits such a file into N per-rank
files (E % N == 0, or N % E == 0 for experts shared by N / E ranks). Same options as Tutel's
`tutel.checkpoint.gather` / `tutel.checkpoint.scatter`. Errors print `error: ...` and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ._distributed import load_tutel_rank_files, save_tutel_state_dict_rank_files
from ._torch_zip import load_torch_file, save_torch_file
from ._tutel_format import NUM_EXPERTS_KEY

_EXIT_ERROR = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tutel_jax.checkpoint",
                                     description="Gather / scatter Tutel per-rank MoE checkpoints (no torch needed).")
    commands = parser.add_subparsers(dest="command", required=True)
    gather = commands.add_parser("gather", help="merge N per-rank files into one file with all experts")
    gather.add_argument("--inputs", required=True, help="per-rank file pattern with {rank} (and {size})")
    gather.add_argument("--input_size", type=int, required=True, help="N, the number of rank files")
    gather.add_argument("--output", required=True, help="the merged torch.save file to write")
    scatter = commands.add_parser("scatter", help="split one file with all experts into N per-rank files")
    scatter.add_argument("--input", required=True, help="a torch.save file with all experts")
    scatter.add_argument("--output_size", type=int, required=True, help="N, the number of rank files to write")
    scatter.add_argument("--outputs", required=True, help="per-rank file pattern with {rank} (and {size})")
    return parser


def _experts_summary(state: dict) -> str:
    counts = sorted({int(v) for k, v in state.items() if k.split(".")[-1] == NUM_EXPERTS_KEY})
    return "/".join(map(str, counts))


def _gather(args: argparse.Namespace) -> str:
    state = load_tutel_rank_files(args.inputs, args.input_size)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)  # as scatter does for its outputs
    save_torch_file(args.output, state)
    return f"gathered {args.input_size} rank files ({_experts_summary(state)} experts) into {args.output}"


def _scatter(args: argparse.Namespace) -> str:
    state = load_torch_file(args.input)
    paths = save_tutel_state_dict_rank_files(state, args.outputs, args.output_size)
    return f"scattered {args.input} ({_experts_summary(state)} experts) into {len(paths)} rank files: {paths[0]} ..."


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit status (0, or 2 after printing `error: ...` to stderr)."""
    args = _parser().parse_args(argv)
    try:
        message = _gather(args) if args.command == "gather" else _scatter(args)
    except (ValueError, TypeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return _EXIT_ERROR
    print(message)
    return 0


if __name__ == "__main__":
    sys.exit(main())
