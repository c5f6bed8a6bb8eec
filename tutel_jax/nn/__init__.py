"""The Flax faces of the functional core: the NNX `MoE` layer (`nnx`), its Linen adapter (`linen`) and an NNX
holder of a loaded causal LM (`causal_lm`)."""

from ._causal_lm import NNXCausalLM
from ._linen import MoELinen
from ._nnx import MoE

__all__ = ["MoE", "MoELinen", "NNXCausalLM"]
