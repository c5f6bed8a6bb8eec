"""HF Mixture-of-Experts decoder families on the tutel-jax MoE block: `FAMILIES` (qwen3_moe, qwen2_moe, mixtral,
deepseek_v3, glm4_moe, gpt_oss, olmoe and aliases), one module each in `models/families/` (see `models.family`).

    from tutel_jax.models import from_pretrained
    model = from_pretrained("path/to/hf_checkpoint")   # config.json + safetensors
    logits = model(input_ids)                           # [B, T] -> float32 [B, T, V]
"""

from .causal_lm import CausalLM, from_pretrained
from .decoder import context_from_mask, forward
from .export import save_pretrained
from .layers import AttnContext
from .memory import MemoryReport, memory_report
from .moe_block import hf_moe_block, hf_moe_block_tensors, moe_layer_indices
from .spec import FAMILIES, DecoderSpec, spec_from_config

__all__ = ["AttnContext", "CausalLM", "DecoderSpec", "FAMILIES", "MemoryReport",
           "context_from_mask", "forward", "from_pretrained", "hf_moe_block", "hf_moe_block_tensors", "memory_report",
           "moe_layer_indices", "save_pretrained", "spec_from_config"]
