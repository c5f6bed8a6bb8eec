"""The platform a program is compiled for, and the one resolver of `kernel_backend`.

A program is compiled *for* devices that need not be the host's: `jax.jit(f).lower(...)` under
`jax.set_mesh(mesh)` of 8 H100s (a deviceless compile through `jax.experimental.topologies` on a CPU host) is a
GPU program, and must hold the project's GPU kernels. So "auto" is resolved from the devices the program is
traced for (`platform()`: an explicit kernel target, else the mesh in context, else the default device), never
from `jax.default_backend()`.

`kernel_backend` (on `make_config`, `MoE`, `from_pretrained`, the experts) has one meaning everywhere, for float
and packed weights alike, with one precedence, call > runtime > config > default:

  * None or "auto": not set at this level; the next level decides. The default ("auto" at every level) is the
    kernels of the platform the program is compiled for: Pallas Triton kernels on GPUs, Mosaic kernels on TPUs
    (each op falls back to its XLA reference where it has no kernel for the platform or the call), plain XLA
    on CPUs;
  * "xla": plain XLA (the library's own code);
  * "pallas" (Triton), "interpret" (Triton kernels in Pallas' interpreter), "tpu" (Mosaic TPU), "tpu_interpret":
    that implementation, no fallback.

The runtime level is the environment variable `TUTEL_JAX_KERNELS` (same names), read by
`pallas_kernels.resolve`, or a `use_kernels(name)` block. `kernels()` is called when an op is traced, so the
choice is baked into the compiled program.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import pallas_kernels

from ..validation import check_choice

__all__ = ["KERNEL_BACKENDS", "PLATFORMS", "check_kernel_backend", "kernels", "platform", "use_kernels"]

#: the valid values of `kernel_backend` (None and "auto" mean the same: not set)
KERNEL_BACKENDS = (None, "auto", "xla", "pallas", "interpret", "tpu", "tpu_interpret")
PLATFORMS = pallas_kernels.PLATFORMS

_runtime: contextvars.ContextVar[str | None] = contextvars.ContextVar("tutel_jax_kernels", default=None)


def check_kernel_backend(value: object, name: str = "kernel_backend") -> str | None:
    """`value` if it is one of KERNEL_BACKENDS (None for "auto"), else ValueError naming `name`."""
    check_choice(value, name, KERNEL_BACKENDS)
    return None if value == "auto" else value


def platform() -> str:
    """'cpu', 'gpu' or 'tpu': the platform of the program being traced (see the module docstring). The one
    place the library reads it."""
    return pallas_kernels.compile_platform()


@contextlib.contextmanager
def use_kernels(name: str | None) -> Iterator[None]:
    """Inside the block, programs traced use kernel implementation `name` unless a call names one (the runtime
    level of the precedence, like `TUTEL_JAX_KERNELS`)."""
    token = _runtime.set(check_kernel_backend(name, "use_kernels(name)"))
    try:
        yield
    finally:
        _runtime.reset(token)


def kernels(config: str | None = None, call: str | None = None) -> str | None:
    """The `pallas_kernels` implementation the ops of a traced program use, or None for the library's own XLA
    code: call > runtime (`use_kernels`, then TUTEL_JAX_KERNELS) > config > default (the platform's kernels).

    Returns None (plain XLA), "auto" (each op: the platform's kernel, its XLA reference where it has none or
    declines the call), or one concrete implementation ("pallas", "interpret", "tpu", "tpu_interpret")."""
    for value in (call, _runtime.get(), pallas_kernels.environment_choice(), config):
        name = check_kernel_backend(value)
        if name is not None:
            return None if name == "xla" else name
    return None if platform() == "cpu" else "auto"
