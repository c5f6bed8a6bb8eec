"""Tutel-compatible namespace: `from tutel_jax import moe` then `moe.moe_layer(...)`, `moe.top_k_routing(...)`,
`moe.fast_encode(...)`, `moe.fast_decode(...)`, as in `from tutel import moe`."""

from .nn import MoE
from .routing import fast_decode, fast_encode, RoutingPlan, top_k_routing

moe_layer = MoE
extract_critical = top_k_routing

__all__ = ["moe_layer", "top_k_routing", "extract_critical", "fast_encode", "fast_decode", "RoutingPlan"]
