"""GPU targets the kernels are built for, and which one a call is traced for.

A target is one GPU generation: what the Triton compiler needs to know (platform, architecture) and the limits
that decide the tiling (shared memory per block, SMs to fill) or the code path (hardware e4m3 conversion).
Kernel tilings are tables keyed by target name (see `tilings.py`); nothing else in the package branches on the
hardware.

| target | GPUs | shared memory / block | e4m3 conversion |
|---|---|---|---|
| sm_80 | A100 (and other Ampere) | 166,912 bytes (163 KiB opt-in) | none: decoded with integer bit operations |
| sm_90 | H100 / H200 | 232,448 bytes (227 KiB opt-in) | hardware |
| sm_100 | B200 / GB200 (and other compute capability 10.x) | 232,448 bytes (227 KiB opt-in) | hardware |
| gfx942 | MI300X / MI300A | 65,536 bytes (64 KiB LDS) | hardware |

Which platform and target a trace compiles for (`compile_platform`, `current_target`): the devices the program
is compiled *for*, which on a host compiling for another machine (deviceless, through
`jax.experimental.topologies`) are not the devices of the host:
1. an explicit `use_target(name)` context (tests and the offline compile export for each target in turn);
2. else the mesh in context (`jax.set_mesh`, `jax.sharding.use_abstract_mesh`, inside `shard_map`): the kind of its
   devices;
3. else the default device: its compute capability (CUDA) or gfx name (ROCm);
4. else `DEFAULT_TARGET` (CPU hosts: the interpreter runs the kernels with that target's tiling).

`lowering_context(target)` additionally hands newer JAX (0.11+), which asks the device for its compute capability
while lowering a Triton kernel, an abstract GPU of that generation, so kernels lower for a GPU on a CPU-only host.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib.util
from pathlib import Path
from typing import Any, Iterator

import jax
from jax.experimental import topologies

__all__ = ["Target", "TARGETS", "DEFAULT_TARGET", "PLATFORMS", "current_target", "use_target", "target_of_device",
           "target_of_kind", "compile_platform", "platform_name", "lowering_context", "get_target",
           "DevicelessUnavailable", "cuda_plugin_dir", "gpu_target_config", "gpu_topology", "compile_only_device"]

#: the platforms a program can be compiled for, as `compile_platform` names them
PLATFORMS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class Target:
    """One GPU generation.

    Attributes:
      name: "sm_80", "sm_90", "sm_100" or "gfx942" (the key of `TARGETS` and of the tiling tables).
      platform: the JAX export platform, "cuda" or "rocm".
      arch: Triton's architecture: the compute capability as an int (80, 90, 100) or the gfx name.
      warp_size: threads per warp (32) or wavefront (64).
      shared_bytes: the most shared memory (LDS) one block may use; Triton checks it only at load time.
      num_sms: streaming multiprocessors / compute units, which split-K heuristics aim to fill.
      fp8_convert: the hardware converts float8_e4m3fn; without it kernels decode e4m3 with integer operations.
      device_kind: the device kind JAX reports for such a GPU (used for an abstract device when lowering).
      gpus: what users call these GPUs.
    """

    name: str
    platform: str
    arch: int | str
    warp_size: int
    shared_bytes: int
    num_sms: int
    fp8_convert: bool
    device_kind: str
    gpus: str


TARGETS: dict[str, Target] = {
    "sm_80": Target("sm_80", "cuda", 80, 32, 166_912, 108, False, "NVIDIA A100-SXM4-80GB", "A100"),
    "sm_90": Target("sm_90", "cuda", 90, 32, 232_448, 132, True, "NVIDIA H100 80GB HBM3", "H100/H200"),
    # Blackwell: the same 227 KiB opt-in shared memory per block as Hopper (CUDA C++ Programming Guide, compute
    # capability 10.0); B200 has 148 SMs
    "sm_100": Target("sm_100", "cuda", 100, 32, 232_448, 148, True, "NVIDIA B200", "B200/GB200"),
    "gfx942": Target("gfx942", "rocm", "gfx942", 64, 65_536, 304, True, "gfx942", "MI300"),
}
DEFAULT_TARGET = "sm_90"

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("tutel_jax_kernel_target", default=None)


def get_target(name: str | Target) -> Target:
    """A Target by name (or the Target itself); a clear error for an unknown name."""
    if isinstance(name, Target):
        return name
    if name not in TARGETS:
        raise ValueError(f"unknown kernel target {name!r}; expected one of {sorted(TARGETS)}")
    return TARGETS[name]


def platform_name(platform: str) -> str:
    """'gpu' for JAX's GPU platform names (gpu, cuda, rocm), 'tpu' for TPUs, 'cpu' for anything else."""
    platform = str(platform).lower()
    if platform in ("gpu", "cuda", "rocm"):
        return "gpu"
    return "tpu" if platform == "tpu" else "cpu"


#: device-kind substrings of compute capability 10.x GPUs ("GB200" contains "B200")
_BLACKWELL_KINDS = ("B100", "B200", "B300")


def target_of_kind(device_kind: str, platform: str = "gpu") -> Target | None:
    """The target of a GPU by its device kind (what an abstract device of a mesh carries): AMD's gfx / MI parts
    map to gfx942, Ampere (A100, A10, A30, A40, RTX A-series) to sm_80, Blackwell data-center parts (B100, B200,
    GB200, B300, GB300) to sm_100, other NVIDIA GPUs to sm_90. None off GPUs."""
    if platform_name(platform) != "gpu":
        return None
    kind = str(device_kind or "")
    upper = kind.upper()
    if platform == "rocm" or upper.startswith("GFX") or "MI2" in upper or "MI3" in upper or "AMD" in upper:
        return TARGETS["gfx942"]
    if any(tag in upper for tag in (" A100", " A10", " A30", " A40", "RTX A")):
        return TARGETS["sm_80"]
    if any(tag in upper for tag in _BLACKWELL_KINDS):
        return TARGETS["sm_100"]
    return TARGETS[DEFAULT_TARGET]


def target_of_device(device: jax.Device) -> Target | None:
    """The target of a JAX GPU device (None for a CPU or TPU device).

    CUDA devices map by compute capability: 10.0 and newer to sm_100, 9.x to sm_90, 8.x to sm_80 (8.9 has e4m3
    hardware, but the bit decoder is exact on it as well). ROCm devices map to gfx942 (the only AMD target; gfx90a shares its LDS
    size). A device without a compute capability maps by its kind (`target_of_kind`)."""
    if device.platform not in ("gpu", "cuda", "rocm"):
        return None
    capability = str(getattr(device, "compute_capability", "") or "")
    kind = str(getattr(device, "device_kind", "") or "")
    if capability.startswith("gfx") or kind.startswith("gfx") or device.platform == "rocm":
        return TARGETS["gfx942"]
    try:
        major = int(capability.split(".")[0])
    except ValueError:
        return target_of_kind(kind, device.platform)
    if major >= 10:
        return TARGETS["sm_100"]
    return TARGETS["sm_90"] if major >= 9 else TARGETS["sm_80"]


def _mesh_device() -> tuple[str, str] | None:
    """(platform, device kind) of the mesh in context, or None when there is none."""
    try:
        mesh = jax.sharding.get_abstract_mesh()
    except Exception:  # noqa: BLE001 - a JAX without abstract meshes: no mesh context to read
        return None
    if mesh is None or getattr(mesh, "empty", True):
        return None
    device = getattr(mesh, "abstract_device", None)
    if device is None or getattr(device, "platform", None) is None:
        return None
    return str(device.platform), str(getattr(device, "device_kind", "") or "")


def _default_device() -> jax.Device | None:
    try:
        return jax.devices()[0]
    except RuntimeError:  # no backend at all
        return None


def compile_platform() -> str:
    """The platform the program being traced is compiled for: 'cpu', 'gpu' or 'tpu'.

    An explicit `use_target` is a GPU; else the mesh in context (a deviceless compile for 8 H100s under
    `jax.set_mesh(mesh)` is 'gpu' on a CPU host); else the default device. The one place the package reads the
    platform: "auto" resolves from it, never from `jax.default_backend()`."""
    if _override.get() is not None:
        return "gpu"
    mesh_device = _mesh_device()
    if mesh_device is not None:
        return platform_name(mesh_device[0])
    device = _default_device()
    return platform_name(device.platform) if device is not None else "cpu"


def current_target() -> Target:
    """The GPU target the kernels are traced for now (see the module docstring for the order)."""
    name = _override.get()
    if name is not None:
        return TARGETS[name]
    mesh_device = _mesh_device()
    if mesh_device is not None:
        return target_of_kind(mesh_device[1], mesh_device[0]) or TARGETS[DEFAULT_TARGET]
    device = _default_device()
    return (target_of_device(device) if device is not None else None) or TARGETS[DEFAULT_TARGET]


@contextlib.contextmanager
def use_target(name: str | Target) -> Iterator[Target]:
    """Trace kernels for `name` inside the block (tiling tables and code paths of that GPU generation)."""
    target = get_target(name)
    token = _override.set(target.name)
    try:
        yield target
    finally:
        _override.reset(token)


def _abstract_gpu_mesh(target: Target):
    """An abstract one-device mesh on a GPU of `target` (JAX versions that have AbstractDevice), else None."""
    device_cls = getattr(jax.sharding, "AbstractDevice", None)
    if device_cls is None:
        return None
    device = device_cls(device_kind=target.device_kind, num_cores=target.num_sms, platform="gpu")
    try:
        return jax.sharding.AbstractMesh((1,), ("_target",), abstract_device=device)
    except TypeError:  # an AbstractMesh without abstract devices
        return None


@contextlib.contextmanager
def lowering_context(name: str | Target) -> Iterator[Target]:
    """`use_target(name)`, plus an abstract GPU of that generation where JAX needs one to lower Triton kernels
    without a GPU (JAX 0.11+). Use it around `jax.export.export(...)` for `target.platform`."""
    target = get_target(name)
    mesh = _abstract_gpu_mesh(target)
    with use_target(target), (jax.sharding.use_abstract_mesh(mesh) if mesh is not None else contextlib.nullcontext()):
        yield target


# ------------------------------------------------------------------------------- deviceless GPU compiles

_CUDA_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


class DevicelessUnavailable(RuntimeError):
    """This JAX cannot compile for the GPU without one (the message says what to install)."""


def cuda_plugin_dir() -> Path | None:
    """The directory of JAX's installed CUDA plugin (the one holding `xla_cuda_plugin.so`), or None."""
    for name in _CUDA_PLUGINS:
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            continue
        if spec is not None and spec.submodule_search_locations:
            d = Path(list(spec.submodule_search_locations)[0])
            if (d / "xla_cuda_plugin.so").is_file():
                return d
    return None


def gpu_target_config(device_kind: str) -> str:
    """The GpuTargetConfigProto text of the GPU model `device_kind` (e.g. 'NVIDIA H100 80GB HBM3'), which XLA's
    GPU compiler needs to compile without the GPU. The CUDA plugin carries one per model: the block from
    `gpu_device_info {` to the line `device_description_str: "<kind>"`."""
    d = cuda_plugin_dir()
    if d is None:
        raise DevicelessUnavailable('the CUDA plugin of jax is not installed: pip install "tutel-jax[cuda12]"')
    data = (d / "xla_cuda_plugin.so").read_bytes()
    tail = f'device_description_str: "{device_kind}"\n'.encode()
    end = data.find(tail)
    start = data.rfind(b"gpu_device_info {", 0, end) if end >= 0 else -1
    if start < 0:
        raise DevicelessUnavailable(f"the installed CUDA plugin has no target description of {device_kind!r}; "
                                    'a newer one may: pip install -U "tutel-jax[cuda12]"')
    return data[start:end + len(tail)].decode()


def gpu_topology(device_kind: str, devices: int = 1, name: str = "gpu") -> Any:
    """A `jax.experimental.topologies` description of `devices` GPUs of `device_kind` on one host (topology
    1x1xN); its `.devices` are compile-only. Needs JAX >= 0.12 and the CUDA plugin."""
    return topologies.get_topology_desc(name, platform="cuda", target_config=gpu_target_config(device_kind),
                                        topology=f"1x1x{int(devices)}")


@functools.lru_cache(maxsize=None)
def compile_only_device(device_kind: str) -> jax.Device | None:
    """One compile-only GPU of `device_kind`, or None where none can be made (no CUDA plugin, an old JAX, a
    plugin without that model)."""
    try:
        return gpu_topology(device_kind).devices[0]
    except Exception:  # noqa: BLE001 - any failure means: no such device here
        return None
