"""Command-line helpers shared by the examples and benchmarks: argparse value types and the CPU device count.

`ensure_host_device_count` only sets XLA_FLAGS; JAX reads it when its backend starts (the first device query),
so call it before touching any device.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Callable

__all__ = ["DEVICE_COUNT_FLAG", "host_core_count", "ensure_host_device_count", "set_host_device_count",
           "int_at_least", "finite_float", "positive_float", "non_negative_float"]

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def host_core_count() -> int:
    """CPU cores available to this process."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def ensure_host_device_count(count: int | None = None) -> None:
    """Unless XLA_FLAGS already sets a host device count, sets it to `count` (default: one per core).

    It only affects the CPU platform, so it is harmless when JAX runs on an accelerator."""
    if DEVICE_COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
        set_host_device_count(host_core_count() if count is None else count)


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
