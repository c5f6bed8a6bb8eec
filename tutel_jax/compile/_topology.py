"""Targets of `tutel-jax compile`: parse `h100x8` / `v5p:2x2x2`, and describe their devices to XLA without them.

    target = parse_target("h100x8")       # Target(hardware=HARDWARE['h100'], devices=8, topology='1x1x8')
    check_deviceless(target)              # DevicelessUnavailable: what to install
    topo = topology_of(target)            # jax.experimental.topologies description: its .devices compile

NVIDIA GPUs: XLA's GPU compiler needs a target description (a GpuTargetConfigProto in text form). The CUDA
plugin carries one per GPU model; `gpu_target_config` takes the block that ends with the model's
`device_description_str`. TPUs: libtpu describes any topology by name (`v5p:2x2x2`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import re
import tempfile
from typing import Any, Iterator

import jax
from jax.experimental import topologies

from pallas_kernels.targets import (
    DevicelessUnavailable,
    cuda_plugin_dir,
    gpu_target_config,
    gpu_topology,
)

from ._hardware import HARDWARE, Hardware

__all__ = ["Target", "TargetError", "DevicelessUnavailable", "parse_target", "check_deviceless",
           "gpu_target_config", "topology_of", "MIN_JAX"]

#: the first JAX whose topologies compile deviceless for GPUs as well as TPUs
MIN_JAX = (0, 12)
#: dimensions of a TPU slice's topology per generation (v5e / v6e: 2D torus, v5p: 3D)
_TPU_DIMS = {"v5e": 2, "v6e": 2, "v5p": 3}


class TargetError(ValueError):
    """A --target value that names no target (the message names the argument and what was expected)."""


@dataclasses.dataclass(frozen=True)
class Target:
    """A parsed target: `devices` devices of `hardware`, laid out as `topology` ('1x1xN' for GPUs, the slice
    shape for TPUs); `spelling` as the user wrote it."""

    spelling: str
    hardware: Hardware
    devices: int
    topology: str

    @property
    def platform(self) -> str:
        return self.hardware.platform


def parse_target(text: str) -> Target:
    """`a100-40gb | a100-80gb | h100 | h200 | b200` with an optional `xN` (N >= 1 devices), or a TPU slice
    `v5e:AxB`, `v6e:AxB`, `v5p:AxBxC`. TargetError naming --target otherwise."""
    gpus = [h.name for h in HARDWARE.values() if h.platform == "gpu"]
    tpus = [h.name for h in HARDWARE.values() if h.platform == "tpu"]
    expected = (f"expected one of {', '.join(gpus)} with an optional xN device count (e.g. h100x8), or a TPU slice "
                f"{', '.join(f'{t}:' + 'x'.join('AB'[:_TPU_DIMS[t]] if _TPU_DIMS[t] == 2 else 'ABC') for t in tpus)}"
                " (e.g. v5p:2x2x2)")
    m = re.fullmatch(r"([a-z0-9-]+?)(?:x(\d+))?", text)
    if m and m.group(1) in gpus:
        count = int(m.group(2) or 1)
        if count < 1:
            raise TargetError(f"--target {text!r}: the device count must be at least 1 (e.g. {m.group(1)}x8)")
        return Target(text, HARDWARE[m.group(1)], count, f"1x1x{count}")
    name, _, shape = text.partition(":")
    if name in tpus:
        dims = _TPU_DIMS[name]
        if not re.fullmatch(r"\d+(?:x\d+)*", shape) or len(shape.split("x")) != dims:
            raise TargetError(f"--target {text!r}: a {name} topology has {dims} dimensions, "
                              f"{'x'.join('AB' if dims == 2 else 'ABC')} of positive integers (e.g. "
                              f"{name}:{'2x4' if dims == 2 else '2x2x2'})")
        sizes = [int(s) for s in shape.split("x")]
        if min(sizes) < 1:
            raise TargetError(f"--target {text!r}: every topology dimension must be at least 1")
        return Target(text, HARDWARE[name], math.prod(sizes), shape)
    raise TargetError(f"--target {text!r}: {expected}")


def _jax_version() -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", jax.__version__)[:3])


def check_deviceless(target: Target) -> None:
    """DevicelessUnavailable unless this JAX (>= 0.12) and the target's compiler (CUDA plugin / libtpu) are here."""
    extra = "cuda12" if target.platform == "gpu" else "tpu"
    install = f'pip install "tutel-jax[{extra}]"'
    if _jax_version()[:2] < MIN_JAX:
        raise DevicelessUnavailable(f"compiling for {target.spelling} without its devices needs jax >= "
                                    f"{'.'.join(map(str, MIN_JAX))} (this is jax {jax.__version__}): {install}")
    if target.platform == "gpu" and cuda_plugin_dir() is None:
        raise DevicelessUnavailable(f"compiling for {target.spelling} needs the CUDA plugin of jax "
                                    f"(jax-cuda12-plugin), which is not installed: {install}")
    if target.platform == "tpu" and importlib.util.find_spec("libtpu") is None:
        raise DevicelessUnavailable(f"compiling for {target.spelling} needs libtpu, which is not installed: {install}")


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silences what native code writes to fd 2 (libtpu warns about the missing TPU host on a CPU machine)."""
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def topology_of(target: Target) -> Any:
    """The `jax.experimental.topologies` description of the target (its `.devices` are compile-only)."""
    check_deviceless(target)
    if target.platform == "gpu":
        return gpu_topology(target.hardware.gpu_target, target.devices, name=target.hardware.name)
    # libtpu guards a local TPU with a lockfile; compiling touches no TPU, so other processes may hold it
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    with _quiet_stderr():
        return topologies.get_topology_desc(f"{target.hardware.name}:{target.topology}", platform="tpu")
