"""Fused gating: router scores -> top-k -> Tutel slot locations (`gating`), and `slot_positions`.

| file | what |
|---|---|
| _reference.py | the semantics in plain JAX, the reference every backend equals |
| _api.py | `gating` / `slot_positions`: backend choice |
| _pallas_triton.py | the Pallas Triton kernel family (NVIDIA, AMD) and its tilings per target |
"""

from ._api import gating, slot_positions
from ._pallas_triton import (GATING_TILINGS, MAX_KERNEL_EXPERTS, GatingConfig, GatingTiling, default_gating_config,
                             tiling_candidates)
from ._reference import GatingResult, gating_reference, slot_positions_reference, group_limited, normalize_weights

__all__ = ["group_limited", "normalize_weights", "gating", "slot_positions", "gating_reference",
           "slot_positions_reference", "GatingResult", "GatingConfig", "GatingTiling", "GATING_TILINGS",
           "MAX_KERNEL_EXPERTS", "default_gating_config", "tiling_candidates"]
