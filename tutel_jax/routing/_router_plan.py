"""Compatibility names for the router routing, now one pipeline for every gate (`routing.pipeline`).

`route_with_router` is `route_tokens` (every gate, Tutel's included, goes through it); `zero_losses` and
`is_router_gate` follow the gate's `selection`.
"""

from __future__ import annotations

from typing import Any

import jax

from ._gates import TUTEL, as_gate
from ._pipeline import route_tokens, zero_losses
from ._plan import RoutingPlan

__all__ = ["is_router_gate", "route_with_router", "zero_losses"]


def is_router_gate(gate: Any) -> bool:
    """True for gates that select experts themselves (`select`) or build their plan (`plan`)."""
    return as_gate(gate).selection != TUTEL


def route_with_router(gate: Any, gate_params: Any, x: jax.Array, num_experts: int, **options
                      ) -> tuple[RoutingPlan, jax.Array, dict[str, jax.Array]]:
    """`routing.pipeline.route_tokens` (same arguments): (plan, l_aux, losses)."""
    return route_tokens(gate, gate_params, x, num_experts, **options)
