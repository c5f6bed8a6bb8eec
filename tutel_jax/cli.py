"""The `tutel-jax` command: `tutel-jax serve CHECKPOINT ...` (OpenAI-compatible server) and
`tutel-jax generate CHECKPOINT --ids 1,2,3 ...` (batch generation from token ids or text prompts).

Every error is one line on stderr, `tutel-jax [COMMAND]: error: ...`, with exit code 2."""

from __future__ import annotations

import sys

from .cli_args import SPELLING_NOTE
from .compile import main as compile_main
from .serving import generate_main as generate, serve_main as serve

COMMANDS = {
    "serve": "OpenAI-compatible HTTP server for a checkpoint (continuous batching, streaming)",
    "generate": "generate from token-id or text prompts, streamed or not, and report the throughput",
    "compile": "compile a model for a GPU / TPU target on this host: memory per device, fit, roofline",
}

HELP = "\n".join([
    "usage: tutel-jax {serve,generate,compile} CHECKPOINT [options]",
    "",
    "Mixture-of-Experts models (Hugging Face MoE checkpoints) with tutel-jax.",
    "",
    "commands:",
    *(f"  {name:<10}  {what}" for name, what in COMMANDS.items()),
    "",
    "tutel-jax COMMAND --help shows a command's options.",
    SPELLING_NOTE,
])


def _error(message: str) -> int:
    print(f"tutel-jax: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("-h", "--help"):
        print(HELP)
        return 0
    if not argv:
        return _error(f"a command is required: {', '.join(COMMANDS)} (tutel-jax --help)")
    command, rest = argv[0], argv[1:]
    try:
        if command == "serve":
            return serve(rest) or 0
        if command == "generate":
            return generate(rest) or 0
        if command == "compile":
            return compile_main(rest)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as e:  # bad input a command did not report itself: still one line, exit 2
        print(f"tutel-jax {command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return _error(f"unknown command {command!r}: choose from {', '.join(COMMANDS)} (tutel-jax --help)")


if __name__ == "__main__":
    sys.exit(main())
