"""`CallOptions`: the MoE layer's per-call switches, defined once.

`moe_apply`, `moe_apply_parallel`, `MoE.__call__`, `MoELinen` and the trainer take these as keyword arguments
and hand one CallOptions down to `layer.moe_pipeline`. Precedence of every knob: the call's value, then the
runtime config (`reconfigure.RuntimeConfig`, where the trainer sets it), then the gate's or the layer config's
default (None here means "not set by the call").
"""

from __future__ import annotations

import dataclasses

from ..validation import check_int

__all__ = ["CallOptions", "DROPLESS_EXCHANGES"]

#: how capacity_factor == 0 crosses devices (see `parallel.exchanges`)
DROPLESS_EXCHANGES = ("padded", "ragged", "auto", "emulated")


@dataclasses.dataclass(frozen=True)
class CallOptions:
    """Per-call overrides of one MoE layer call (all static under jit).

    Attributes:
      top_k, capacity_factor, gate_index: override the gate's defaults (capacity_factor: > 0 fixed, 0 dropless,
        < 0 bounded dropless, Tutel's semantics).
      a2a_ffn_overlap_degree: chunks of the capacity axis (default from the config); it aligns the capacity.
      use_2dh: hierarchical all_to_all over two expert axes (expert parallel; default from the config).
      adaptive_r: Tutel's r for sharded experts (expert parallel; default from config.parallel_type).
      inequivalent_tokens: agree the capacity over the expert group from the largest valid token count.
      dropless_exchange: how a dropless plan crosses devices, one of DROPLESS_EXCHANGES.
      recv_capacity: rows each device can receive in the ragged exchange (default 2 x k x S_local).
    """

    top_k: int | None = None
    capacity_factor: float | None = None
    gate_index: int = 0
    a2a_ffn_overlap_degree: int | None = None
    use_2dh: bool | None = None
    adaptive_r: int | None = None
    inequivalent_tokens: bool = False
    dropless_exchange: str = "padded"
    recv_capacity: int | None = None

    def overlap_degree(self, config) -> int:
        """The call's a2a_ffn_overlap_degree, else the config's; at least 1."""
        degree = config.a2a_ffn_overlap_degree if self.a2a_ffn_overlap_degree is None else \
            self.a2a_ffn_overlap_degree
        return check_int(degree, "a2a_ffn_overlap_degree", minimum=1)
