"""tutel-jax: Mixture-of-Experts for JAX with Tutel-exact routing.

Public surface:
  MoE                        the Flax NNX layer (Tutel's `moe_layer` arguments)
  moe                        Tutel-compatible namespace (moe_layer, top_k_routing, fast_encode, fast_decode)
  MoEConfig, make_config     the layer's static description
  init_params, moe_apply     the functional core: pure functions over parameter pytrees, (y, aux) out
  MoEAux                     aux loss and routing statistics of one call
  nn.MoELinen                Flax Linen adapter
"""

import importlib

from . import moe
from .core import gshard_loss, load_importance_loss
from .experts import Experts, FFNExperts, LlamaFFNExperts, register_experts
from .layer import MoEAux, MoEConfig, init_params, make_config, moe_apply, route
from .nn import MoE
from .routing import Gate, RoutingPlan, register_gate, top_k_routing, fast_decode, fast_encode

__version__ = "0.1.0"

__all__ = ["MoE", "moe", "MoEConfig", "make_config", "init_params", "moe_apply", "route", "MoEAux", "fast_encode",
           "fast_decode", "top_k_routing", "RoutingPlan", "Gate", "register_gate", "Experts", "FFNExperts",
           "LlamaFFNExperts", "register_experts", "gshard_loss", "load_importance_loss"]

#: heavier subpackages load on first use (`tutel_jax.models.from_pretrained(...)`); earlier names of moved modules
_LAZY_SUBMODULES = {"models": "models", "serving": "serving", "parallel": "parallel", "checkpoint": "checkpoint",
                    "runtime": "runtime", "reconfigure": "runtime._reconfigure", "training": "training",
                    "linen": "nn._linen"}


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{_LAZY_SUBMODULES[name]}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
