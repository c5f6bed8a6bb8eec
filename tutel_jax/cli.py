"""The `tutel-jax` command: `tutel-jax serve CHECKPOINT ...` (OpenAI-compatible server) and
`tutel-jax generate CHECKPOINT --ids 1,2,3 ...` (batch generation from token ids)."""

from __future__ import annotations

import sys

USAGE = "usage: tutel-jax {serve,generate} CHECKPOINT [options]   (tutel-jax <command> --help for options)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from .serving.server import main as serve
        return serve(rest) or 0
    if command == "generate":
        from .serving.generate_cli import main as generate
        return generate(rest) or 0
    print(f"tutel-jax: error: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
