"""XLA flags of the test processes (conftest sets them; subprocesses that compare against them use the same)."""

from __future__ import annotations

from importlib.metadata import version

# Tests compile far more than they compute: XLA:CPU's code generation without LLVM's optimization passes takes ~40%
# less time over the suite (the programs' results are the same in kind; they run a little slower)
FAST_COMPILE = "--xla_backend_optimization_level=0"
# jaxlib 0.10's XLA:CPU emits fusions through MLIR by default; its older emitters compile a test's small programs in
# about 40% less time again. Later jaxlibs have no such flag (and abort on an unknown one): added for 0.10 only.
OLD_FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _jaxlib_has_fusion_emitter_flag() -> bool:
    major, minor = (int(part) for part in version("jaxlib").split(".")[:2])
    return (major, minor) < (0, 11)


def with_fast_compile(xla_flags: str) -> str:
    """`xla_flags` plus FAST_COMPILE (unless it already sets an optimization level) and, on jaxlib 0.10,
    OLD_FUSION_EMITTERS (unless it already chooses the fusion emitters)."""
    flags = xla_flags.split()
    if not any(f.startswith("--xla_backend_optimization_level") for f in flags):
        flags.append(FAST_COMPILE)
    if _jaxlib_has_fusion_emitter_flag() and not any(f.startswith("--xla_cpu_use_fusion_emitters") for f in flags):
        flags.append(OLD_FUSION_EMITTERS)
    return " ".join(flags)
