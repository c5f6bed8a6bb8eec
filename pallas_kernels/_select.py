"""Choosing between a Pallas kernel and its plain-XLA reference (tokamax style).

Every op in this package has an ordered list of implementations: the Pallas (Triton backend) kernel first, the
XLA reference last. A call resolves its `implementation=` argument like this:

1. an explicit name ("xla", "pallas", "interpret") wins: the op runs that implementation or raises;
2. "auto" (the default) reads the environment variable `TUTEL_JAX_KERNELS` (same names, or "auto");
3. still "auto": the kernel on a GPU backend (with the reference as fallback when the kernel does not support
   the call, e.g. too many experts for one tile), the XLA reference everywhere else (CPU, TPU).

"interpret" runs the same kernel through Pallas' interpreter (`interpret=True`): slow, CPU-only, used by the
tests to check the kernels against their references without a GPU.

The choice is made when the op is traced (shapes and the backend are known then), so under `jax.jit` it is
baked into the compiled program; set the environment variable before the first trace.
"""

from __future__ import annotations

import os
from typing import Callable, Literal

import jax

__all__ = ["ENV_VAR", "IMPLEMENTATIONS", "Implementation", "NotSupported", "resolve", "resolved_name",
           "gpu_backend", "choose"]

ENV_VAR = "TUTEL_JAX_KERNELS"
#: concrete implementations, in the order "auto" tries them on a GPU
IMPLEMENTATIONS: tuple[str, ...] = ("pallas", "xla")
Implementation = Literal["auto", "xla", "pallas", "interpret"]
_NAMES = ("auto", "xla", "pallas", "interpret")
# accepted spellings of the same thing
_ALIASES = {"triton": "pallas", "kernel": "pallas", "reference": "xla", "ref": "xla", "": "auto"}


class NotSupported(ValueError):
    """Raised by a kernel (at trace time) for a call it cannot handle; "auto" then falls back to XLA."""


def _normalise(name: str | None, source: str) -> str:
    if name is None:
        return "auto"
    if not isinstance(name, str):
        raise TypeError(f"{source} must be a string, got {type(name).__name__}")
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in _NAMES:
        raise ValueError(f"{source} must be one of {_NAMES}, got {name!r}")
    return key


def gpu_backend() -> bool:
    """True when JAX's default backend is a GPU (CUDA or ROCm), where the Triton kernels run."""
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def resolve(implementation: str | None = "auto") -> tuple[str, ...]:
    """The implementations a call will try, in order.

    Args:
      implementation: "auto" (or None), "xla", "pallas" or "interpret".

    Returns:
      A non-empty tuple of concrete names; more than one only for "auto" on a GPU (kernel, then XLA).
    """
    name = _normalise(implementation, "implementation")
    if name == "auto":
        name = _normalise(os.environ.get(ENV_VAR), ENV_VAR)
    if name != "auto":
        return (name,)
    return IMPLEMENTATIONS if gpu_backend() else ("xla",)


def resolved_name(implementation: str | None = "auto") -> str:
    """The first implementation `resolve` would try (what a call runs unless the kernel declines)."""
    return resolve(implementation)[0]


def choose(implementation: str | None, check: Callable[[], None] | None = None) -> str:
    """Picks the concrete implementation of one call.

    Args:
      implementation: as for `resolve`.
      check: optional callable that raises NotSupported when the kernel cannot handle this call (shapes,
        dtypes, sizes); "auto" then moves on to the XLA reference, an explicit kernel choice re-raises.

    Returns:
      "xla", "pallas" or "interpret".
    """
    order = resolve(implementation)
    for position, name in enumerate(order):
        if name == "xla" or check is None:
            return name
        try:
            check()
            return name
        except NotSupported:
            if position == len(order) - 1:
                raise
    raise AssertionError("unreachable: resolve() always returns at least one name")
