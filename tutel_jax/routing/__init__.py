"""Gates, modern routers, Tutel's top-k routing plan and the one routing pipeline (`route_tokens`)."""

from .gates import CosineTopGate, Gate, GATE_TYPES, GateAdapter, MinimalGate, TopGate, as_gate, make_gate, register_gate
from .plan import RoutingPlan, align_capacity, plan_from_choices, slot_positions, static_capacity, top_k_routing
from .routers import (DeepSeekV3Router, ExpertChoiceRouter, GptOssRouter, MixtralRouter, Qwen3MoeRouter,
                      RouterChoices, SoftmaxRouter, SwitchRouter)
from .pipeline import route_tokens, zero_losses

__all__ = ["CosineTopGate", "Gate", "GATE_TYPES", "GateAdapter", "MinimalGate", "TopGate", "as_gate", "make_gate",
           "register_gate", "route_tokens", "zero_losses", "RoutingPlan",
           "align_capacity", "plan_from_choices", "slot_positions", "static_capacity", "top_k_routing",
           "RouterChoices", "SoftmaxRouter", "MixtralRouter", "Qwen3MoeRouter", "SwitchRouter", "GptOssRouter",
           "DeepSeekV3Router", "ExpertChoiceRouter"]
