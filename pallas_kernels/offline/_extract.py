"""Triton kernels out of an exported JAX program (runs with JAX; no GPU, no triton package).

A Pallas kernel lowered for the Triton backend becomes a `stablehlo.custom_call @__gpu$xla.gpu.triton` whose
`mhlo.backend_config` dictionary holds the kernel's Triton module as MLIR bytecode (`ir`) next to its launch
parameters (`num_warps`, `num_stages`, `grid_x/y/z`). The pip `triton` package cannot read jaxlib's bytecode but
reads the textual form, so each module is re-printed as text here.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable, Sequence

import jax
from jax.interpreters import mlir as jax_mlir
from jaxlib.mlir import ir
from jaxlib.triton import dialect as triton_dialect

TRITON_CALL = "__gpu$xla.gpu.triton"

__all__ = ["TRITON_CALL", "TritonKernel", "export_for", "triton_kernels", "kernels_of"]


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """One Triton kernel of an exported program.

    Attributes:
      name: the kernel's name (the `pallas_call` name).
      ttir: the Triton module as MLIR text (without debug locations, so equal kernels give equal text).
      num_warps, num_stages: the launch parameters the kernel was lowered with.
      grid: (x, y, z) program grid.
    """

    name: str
    ttir: str
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]

    @property
    def digest(self) -> str:
        """A hash of everything the compile depends on (module text and launch parameters)."""
        key = f"{self.num_warps}/{self.num_stages}\n{self.ttir}"
        return hashlib.sha256(key.encode()).hexdigest()[:20]


def export_for(fn: Callable[..., Any], args: Sequence[Any], platform: str) -> jax.export.Exported:
    """`jax.export` of `jax.jit(fn)(*args)` for "cuda" or "rocm", with the Triton custom call allowed."""
    return jax.export.export(
        jax.jit(fn), platforms=[platform],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args)


def _custom_calls(op, found: list) -> None:
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                if child.operation.name == "stablehlo.custom_call":
                    found.append(child)
                _custom_calls(child.operation, found)


def triton_kernels(module_text: str) -> list[TritonKernel]:
    """Every Triton kernel of a StableHLO module (text of `Exported.mlir_module()`), in program order."""

    context = jax_mlir.make_ir_context()
    triton_dialect.register_dialect(context)
    kernels = []
    with context:
        module = ir.Module.parse(module_text)
        calls: list = []
        _custom_calls(module.operation, calls)
        for call in calls:
            if ir.StringAttr(call.attributes["call_target_name"]).value != TRITON_CALL:
                continue
            config = ir.DictAttr(call.attributes["mhlo.backend_config"])
            kernel_module = ir.Module.parse(bytes(ir.StringAttr(config["ir"]).value_bytes))
            ttir = kernel_module.operation.get_asm(enable_debug_info=False)
            number = lambda key: int(ir.IntegerAttr(config[key]).value)
            kernels.append(TritonKernel(
                name=ir.StringAttr(config["name"]).value, ttir=ttir, num_warps=number("num_warps"),
                num_stages=number("num_stages"), grid=(number("grid_x"), number("grid_y"), number("grid_z"))))
    return kernels


def kernels_of(fn: Callable[..., Any], args: Sequence[Any], platform: str) -> list[TritonKernel]:
    """The Triton kernels `fn(*args)` runs when compiled for `platform` (forward, and backward if fn takes
    gradients)."""
    return triton_kernels(export_for(fn, args, platform).mlir_module())
