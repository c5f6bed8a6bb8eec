"""Gates, modern routers, Tutel's top-k routing plan and the one routing pipeline (`route_tokens`)."""

from ._gates import (CosineTopGate, Gate, GATE_TYPES, GateAdapter, MinimalGate, TopGate, as_gate, make_gate,
                     register_gate, PLAN)
from ._plan import RoutingPlan, align_capacity, plan_from_choices, slot_positions, static_capacity, top_k_routing
from ._routers import (DeepSeekV3Router, ExpertChoiceRouter, GptOssRouter, MixtralRouter, Qwen3MoeRouter,
                       RouterChoices, SoftmaxRouter, SwitchRouter, CORRECTION_BIAS, trainable_mask)
from ._pipeline import route_tokens, zero_losses
from ._dispatch import fast_decode, fast_encode, group_row_experts, assignment_weights, permute, unpermute

__all__ = ["assignment_weights", "permute", "unpermute", "CORRECTION_BIAS", "trainable_mask", "PLAN", "fast_decode",
           "fast_encode", "group_row_experts", "CosineTopGate", "Gate", "GATE_TYPES", "GateAdapter", "MinimalGate",
           "TopGate", "as_gate", "make_gate", "register_gate", "route_tokens", "zero_losses", "RoutingPlan",
           "align_capacity", "plan_from_choices", "slot_positions", "static_capacity", "top_k_routing",
           "RouterChoices", "SoftmaxRouter", "MixtralRouter", "Qwen3MoeRouter", "SwitchRouter", "GptOssRouter",
           "DeepSeekV3Router", "ExpertChoiceRouter"]
