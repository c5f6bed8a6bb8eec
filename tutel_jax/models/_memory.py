"""Resident memory of a model's expert weights, against the same weights stored in bfloat16."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from .. import quant

__all__ = ["MemoryReport", "memory_report"]


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """expert_bytes: bytes the routed experts' arrays hold now (packed values and scales for quantized
    weights); expert_bf16_bytes: the same weights as bfloat16 (2 bytes per logical element);
    total_bytes: all parameters; formats: the expert weight formats found ('float' for plain arrays)."""

    expert_bytes: int
    expert_bf16_bytes: int
    total_bytes: int
    formats: tuple[str, ...]

    @property
    def expert_ratio(self) -> float:
        """expert_bytes / expert_bf16_bytes (FP8 block about 0.5, MXFP4 / NVFP4 about 0.27-0.28)."""
        return self.expert_bytes / self.expert_bf16_bytes

    def __str__(self) -> str:
        return (f"expert weights {self.expert_bytes / 2**20:.2f} MiB ({'/'.join(self.formats)}) = "
                f"{self.expert_ratio:.3f} x bf16 ({self.expert_bf16_bytes / 2**20:.2f} MiB); "
                f"all parameters {self.total_bytes / 2**20:.2f} MiB")


def _expert_leaves(params: dict) -> list:
    """The routed experts' weights of every MoE layer, containers kept whole."""
    out = []
    for layer in params["layers"]:
        if "moe" in layer:
            out.extend(jax.tree_util.tree_leaves(layer["moe"]["experts"], is_leaf=quant.is_quantized))
    return out


def memory_report(model: Any) -> MemoryReport:
    """MemoryReport of a `CausalLM` (anything with `.params` in its layout)."""
    leaves = _expert_leaves(model.params)
    if not leaves:
        raise ValueError("the model has no MoE layers")
    resident = quant.resident_bytes(leaves)
    bf16 = sum(2 * math.prod(quant.logical_shape(w)) for w in leaves)
    formats = sorted({w.format if quant.is_quantized(w) else "float" for w in leaves})
    return MemoryReport(resident, bf16, quant.resident_bytes(model.params), tuple(formats))
