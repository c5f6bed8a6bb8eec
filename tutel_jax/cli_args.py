"""Command-line helpers shared by the `tutel-jax` commands, the examples and the benchmarks: the commands'
argument parser (`CommandParser`: one-line errors, flags with dashes or underscores), argparse value types and
the CPU device count.

`ensure_host_device_count` only sets XLA_FLAGS; JAX reads it when its backend starts (the first device query),
so call it before touching any device.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any, Callable

from .core import usable_cpus

__all__ = ["DEVICE_COUNT_FLAG", "CommandParser", "ensure_host_device_count",
           "set_host_device_count", "int_at_least", "int_in_range", "finite_float", "positive_float",
           "non_negative_float", "checked", "add_compile_cache_argument"]

SPELLING_NOTE = "Every flag may also be spelled with underscores for its dashes (--max_new_tokens = --max-new-tokens)."


class CommandParser(argparse.ArgumentParser):
    """The `tutel-jax` commands' parser: an error is one line on stderr, `PROG: error: MESSAGE`, exit code 2
    (no usage block; `PROG --help` shows it), and every long flag is accepted with underscores for its dashes
    (`--max_batch_size` = `--max-batch-size`; the help shows the dashed form). `fail(message)` prints an error
    the same way after parsing and returns 2 for the command to return."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("epilog", SPELLING_NOTE)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(self._dashed(args), namespace)

    def _dashed(self, args: list[str]) -> list[str]:
        """args with `--some_flag[=value]` spelled `--some-flag[=value]` where that names (or abbreviates) one
        of this parser's flags; values, a lone `--` and everything after it are left alone."""
        longs = [o for o in self._option_string_actions if o.startswith("--")]
        out = []
        for k, arg in enumerate(args):
            if arg == "--":
                return out + args[k:]
            if arg.startswith("--") and "_" in arg.partition("=")[0]:
                name, eq, value = arg.partition("=")
                dashed = "--" + name[2:].replace("_", "-")
                if any(o.startswith(dashed) for o in longs):
                    arg = dashed + eq + value
            out.append(arg)
        return out

    def error(self, message: str):
        self.exit(2, self._line(message))

    def fail(self, message: str) -> int:
        """Prints `PROG: error: MESSAGE` (one line) on stderr and returns 2."""
        sys.stderr.write(self._line(message))
        sys.stderr.flush()
        return 2

    def _line(self, message: Any) -> str:
        return f"{self.prog}: error: {' '.join(str(message).split())}\n"

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def ensure_host_device_count(count: int | None = None) -> None:
    """Unless XLA_FLAGS already sets a host device count, sets it to `count` (default: one per core).

    It only affects the CPU platform, so it is harmless when JAX runs on an accelerator."""
    if DEVICE_COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
        set_host_device_count(usable_cpus() if count is None else count)


def set_host_device_count(count: int) -> None:
    """Sets the host device count in XLA_FLAGS, replacing any earlier setting."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    os.environ["XLA_FLAGS"] = " ".join(kept + [f"{DEVICE_COUNT_FLAG}={int(count)}"])


def int_at_least(minimum: int) -> Callable[[str], int]:
    """argparse type: an integer >= minimum."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    parse.__name__ = f"integer >= {minimum}"
    return parse


def int_in_range(lo: int, hi: int) -> Callable[[str], int]:
    """argparse type: an integer in [lo, hi]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {value}")
        return value
    parse.__name__ = f"integer in [{lo}, {hi}]"
    return parse


def checked(check: Callable[[Any], Any], parse: Callable[[str], Any] = float) -> Callable[[str], Any]:
    """argparse type: `check(parse(text))`, where check raises ValueError with its own message (e.g. the
    sampling checks of `tutel_jax.serving._sampling`, so the command line and the library share their rules)."""
    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            kind = "an integer" if parse is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        try:
            return check(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = getattr(check, "__name__", "value")
    return convert


def finite_float(text: str) -> float:
    """argparse type: a finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


MODEL_DTYPES = ("auto", "float32", "bfloat16")


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """`--dtype` of the commands that load a checkpoint (`models.from_pretrained`'s dtype; default 'auto')."""
    parser.add_argument("--dtype", default="auto", choices=MODEL_DTYPES,
                        help="the model's float weights and activations (packed expert weights stay packed); auto "
                             "(default): the checkpoint's own where it is bfloat16, else float32")


def add_compile_cache_argument(parser: argparse.ArgumentParser) -> None:
    """`--compile-cache` of the commands that compile a model's programs (`core.enable_compile_cache`)."""
    parser.add_argument("--compile-cache", default=None, metavar="DIR|off",
                        help="keep the compiled programs in DIR (a folder per machine and jax version) and load them "
                             "in later runs instead of compiling again; 'off': compile in every run (default: "
                             "$TUTEL_JAX_COMPILE_CACHE, else the xla folder of tutel-jax's user cache)")
