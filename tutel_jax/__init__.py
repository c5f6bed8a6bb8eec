"""tutel-jax: Mixture-of-Experts for JAX with Tutel-exact routing.

Public surface:
  MoE                        the Flax NNX layer (Tutel's `moe_layer` arguments)
  moe                        Tutel-compatible namespace (moe_layer, top_k_routing, fast_encode, fast_decode)
  MoEConfig, make_config     the layer's static description
  init_params, moe_apply     the functional core: pure functions over parameter pytrees, (y, aux) out
  MoEAux                     aux loss and routing statistics of one call
  linen.MoELinen             Flax Linen adapter
"""

import importlib

from . import moe
from .config import MoEConfig, make_config
from .dispatch import fast_decode, fast_encode
from .experts import Experts, FFNExperts, LlamaFFNExperts, register_experts
from .layer import MoEAux, init_params, moe_apply, route
from .losses import gshard_loss, load_importance_loss
from .module import MoE
from .routing import Gate, RoutingPlan, register_gate, top_k_routing

__version__ = "0.1.0"

__all__ = [
    "MoE", "moe", "MoEConfig", "make_config", "init_params", "moe_apply", "route", "MoEAux",
    "fast_encode", "fast_decode", "top_k_routing", "RoutingPlan", "Gate", "register_gate",
    "Experts", "FFNExperts", "LlamaFFNExperts", "register_experts", "gshard_loss", "load_importance_loss",
]

_LAZY_SUBMODULES = ("models", "serving", "parallel", "checkpoint", "reconfigure", "training", "linen")


def __getattr__(name):  # heavier subpackages load on first use: `tutel_jax.models.from_pretrained(...)`
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
