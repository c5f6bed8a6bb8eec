"""The Flax faces of the functional core: the NNX `MoE` layer (`nnx`), its Linen adapter (`linen`) and an NNX
holder of a loaded causal LM (`causal_lm`)."""

from .causal_lm import NNXCausalLM
from .linen import MoELinen
from .nnx import MoE

__all__ = ["MoE", "MoELinen", "NNXCausalLM"]
