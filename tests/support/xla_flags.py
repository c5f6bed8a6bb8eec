"""XLA flags of the test processes (conftest sets them; subprocesses that compare against them use the same)."""

from __future__ import annotations

# Tests compile far more than they compute: XLA:CPU's code generation without LLVM's optimization passes takes ~40%
# less time over the suite (the programs' results are the same in kind; they run a little slower)
FAST_COMPILE = "--xla_backend_optimization_level=0"


def with_fast_compile(xla_flags: str) -> str:
    """`xla_flags` plus FAST_COMPILE, unless it already sets an optimization level."""
    if "--xla_backend_optimization_level" in xla_flags:
        return xla_flags
    return f"{xla_flags} {FAST_COMPILE}".strip()
