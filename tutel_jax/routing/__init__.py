"""Gates, modern routers and Tutel's top-k routing plan."""

from .gates import CosineTopGate, Gate, GATE_TYPES, TopGate, make_gate, register_gate
from .plan import RoutingPlan, align_capacity, plan_from_choices, slot_positions, static_capacity, top_k_routing
from .routers import (DeepSeekV3Router, ExpertChoiceRouter, GptOssRouter, MixtralRouter, Qwen3MoeRouter,
                      RouterChoices, SoftmaxRouter, SwitchRouter)

__all__ = ["CosineTopGate", "Gate", "GATE_TYPES", "TopGate", "make_gate", "register_gate", "RoutingPlan",
           "align_capacity", "plan_from_choices", "slot_positions", "static_capacity", "top_k_routing",
           "RouterChoices", "SoftmaxRouter", "MixtralRouter", "Qwen3MoeRouter", "SwitchRouter", "GptOssRouter",
           "DeepSeekV3Router", "ExpertChoiceRouter"]
