"""Choosing between a Pallas kernel and its plain-XLA reference (tokamax style).

Every op in this package has an ordered list of implementations: the platform's Pallas kernel first (Triton
on GPUs, Mosaic on TPUs, where the op has one), the XLA reference last. A call resolves its `implementation=`
argument like this (call > runtime > default):

1. an explicit name ("xla", "pallas", "interpret", "tpu", "tpu_interpret", "mosaic_gpu") wins: the op runs that
   implementation or raises;
2. "auto" (the default) reads the environment variable `TUTEL_JAX_KERNELS` (same names, or "auto");
3. still "auto": the kernel of the platform the program is compiled for (`targets.compile_platform`: the mesh in
   context, else the default device; a deviceless compile for GPUs on a CPU host is a GPU program), with the
   reference as fallback when the kernel does not support the call (e.g. too many experts for one tile) or the
   op has no kernel for that platform; the XLA reference on CPUs.

"interpret" runs the Triton kernel through Pallas' interpreter (`interpret=True`), "tpu_interpret" the Mosaic TPU
kernel: slow, CPU-only, used by the tests to check the kernels against their references without a device.

"mosaic_gpu" is tokamax's Mosaic GPU `ragged_dot` (an optional dependency: Python >= 3.12, jax >= 0.11.1) for
the grouped matmul's forward on Hopper and Blackwell (targets sm_90 and sm_100), asked for by name: an op that
has it passes `mosaic_gpu=` to `choose`. "auto" keeps the Triton kernel first on every GPU: measured on an H200,
tokamax's forward matched the reference (5e-7) and was 2.3x faster than Triton at 1031 rows but 0.79x at the
prefill / training size (T=16384, K=4096, N=1536, 64 groups), and its weight-gradient kernel gave wrong results
(so tgmm never uses it).

The choice is made when the op is traced (shapes and the target are known then), so under `jax.jit` it is
baked into the compiled program; set the environment variable before the first trace.
"""

from __future__ import annotations

import os
from typing import Callable, Literal

from .targets import compile_platform

__all__ = ["ENV_VAR", "IMPLEMENTATIONS", "AUTO_ORDER", "Implementation", "NotSupported", "resolve", "resolved_name",
           "gpu_backend", "choose", "TPU_IMPLEMENTATIONS", "environment_choice", "MOSAIC_GPU_TARGETS"]

ENV_VAR = "TUTEL_JAX_KERNELS"
#: concrete implementations, in the order "auto" tries them on a GPU
IMPLEMENTATIONS: tuple[str, ...] = ("pallas", "xla")
#: what "auto" tries, by the platform the program is compiled for
AUTO_ORDER: dict[str, tuple[str, ...]] = {"gpu": IMPLEMENTATIONS, "tpu": ("tpu", "xla"), "cpu": ("xla",)}
#: the Mosaic TPU kernel, compiled or interpreted
TPU_IMPLEMENTATIONS = ("tpu", "tpu_interpret")
#: GPU targets with a Mosaic GPU kernel (tokamax's sm90 / sm100 ragged_dot)
MOSAIC_GPU_TARGETS = ("sm_90", "sm_100")
Implementation = Literal["auto", "xla", "pallas", "interpret", "tpu", "tpu_interpret", "mosaic_gpu"]
_NAMES = ("auto", "xla", "pallas", "interpret", "tpu", "tpu_interpret", "mosaic_gpu")
# accepted spellings of the same thing
_ALIASES = {"triton": "pallas", "kernel": "pallas", "reference": "xla", "ref": "xla", "": "auto",
            "mosaic_tpu": "tpu", "mosaic": "tpu"}


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
    """True when the program being traced is compiled for a GPU (CUDA or ROCm), where the Triton kernels run."""
    return compile_platform() == "gpu"


def environment_choice() -> str | None:
    """The implementation `TUTEL_JAX_KERNELS` names, or None when it is unset or "auto" (the one reader of the
    variable)."""
    name = _normalise(os.environ.get(ENV_VAR), ENV_VAR)
    return None if name == "auto" else name


def resolve(implementation: str | None = "auto", mosaic_gpu: bool = False) -> tuple[str, ...]:
    """The implementations a call will try, in order.

    Args:
      implementation: "auto" (or None), "xla", "pallas", "interpret", "tpu", "tpu_interpret" or "mosaic_gpu".
      mosaic_gpu: the op has a Mosaic GPU kernel: "auto" on a GPU puts it first where it can be tried
        (`gmm.pallas_mosaic_gpu.mosaic_gpu_unavailable` is None).

    Returns:
      A non-empty tuple of concrete names; more than one only for "auto" on a GPU or TPU (kernel(s), then XLA).
    """
    name = _normalise(implementation, "implementation")
    if name == "auto":
        name = environment_choice() or "auto"
    if name != "auto":
        return (name,)
    # "mosaic_gpu" is asked for by name only: on an H200 its forward was 2.3x faster than the Triton gmm for
    # 1031 rows but 0.79x at T=16384, K=4096, N=1536 (the prefill and training size), so "auto" keeps Triton
    del mosaic_gpu
    return AUTO_ORDER[compile_platform()]


def resolved_name(implementation: str | None = "auto", mosaic_gpu: bool = False) -> str:
    """The first implementation `resolve` would try (what a call runs unless the kernel declines)."""
    return resolve(implementation, mosaic_gpu)[0]


def choose(implementation: str | None, check: Callable[[], None] | None = None,
           tpu: bool | Callable[[], None] = False, mosaic_gpu: bool | Callable[[], None] = False) -> str:
    """Picks the concrete implementation of one call.

    Args:
      implementation: as for `resolve`.
      check: optional callable that raises NotSupported when the Triton kernel cannot handle this call (shapes,
        dtypes, sizes); "auto" then moves on to the XLA reference, an explicit kernel choice re-raises.
      tpu: whether the op has a Mosaic TPU kernel (False: "tpu" is not supported), or that kernel's check
        (a callable as `check`).
      mosaic_gpu: whether the op has a Mosaic GPU kernel (False: "mosaic_gpu" is not supported and "auto" never
        tries it), or that kernel's check (a callable as `check`: tokamax, the target, then the call).

    Returns:
      "xla", "pallas", "interpret", "tpu", "tpu_interpret" (the last two only where `tpu` is not False) or
      "mosaic_gpu" (only where `mosaic_gpu` is not False).
    """
    order = resolve(implementation, mosaic_gpu is not False)
    for position, name in enumerate(order):
        kernel_check = check
        if name in TPU_IMPLEMENTATIONS:
            kernel_check = _no_tpu_kernel if tpu is False else (None if tpu is True else tpu)
        elif name == "mosaic_gpu":
            kernel_check = _no_mosaic_gpu_kernel if mosaic_gpu is False else (None if mosaic_gpu is True else mosaic_gpu)
        if name == "xla" or kernel_check is None:
            return name
        try:
            kernel_check()
            return name
        except NotSupported:
            if position == len(order) - 1:
                raise
    raise AssertionError("unreachable: resolve() always returns at least one name")


def _no_tpu_kernel() -> None:
    raise NotSupported("this op has no Mosaic TPU kernel; it runs its XLA reference on TPUs")


def _no_mosaic_gpu_kernel() -> None:
    raise NotSupported("this op has no Mosaic GPU kernel (only gmm has one, through tokamax); use 'pallas' on GPUs")
