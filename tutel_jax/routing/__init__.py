"""Gates and Tutel's top-k routing plan."""

from .gates import CosineTopGate, Gate, GATE_TYPES, TopGate, make_gate, register_gate
from .plan import RoutingPlan, align_capacity, slot_positions, static_capacity, top_k_routing

__all__ = ["CosineTopGate", "Gate", "GATE_TYPES", "TopGate", "make_gate", "register_gate", "RoutingPlan",
           "align_capacity", "slot_positions", "static_capacity", "top_k_routing"]
