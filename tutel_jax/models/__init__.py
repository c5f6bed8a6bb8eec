"""HF Mixture-of-Experts decoder families on the tutel-jax MoE block: `FAMILIES` (qwen3_moe, qwen2_moe, mixtral,
deepseek_v3, glm4_moe, gpt_oss, olmoe and aliases), one module each in `models/families/` (see `models.family`).

    from tutel_jax.models import from_pretrained
    model = from_pretrained("path/to/hf_checkpoint")   # config.json + safetensors
    logits = model(input_ids)                           # [B, T] -> float32 [B, T, V]
"""

from ._causal_lm import CausalLM, from_pretrained, PER_LAYER_JIT_CHOICES
from ._decoder import context_from_mask, forward, decoder_layer, embed, head
from ._export import save_pretrained
from ._layers import AttnContext
from ._memory import MemoryReport, memory_report
from ._moe_block import hf_moe_block, hf_moe_block_tensors, moe_layer_indices, num_experts_of
from ._spec import FAMILIES, DecoderSpec, spec_from_config
from ._attention import cache_dims
from ._dequant import QuantizedTensors, check_quantization_config
from ._family import moe_hidden_size
from ._hf_tables import attention_table, load_params, mlp_prefix
from ._layer_programs import LayerPrograms, ModelStep, program_table
from ._quant_layout import checkpoint_layout, stored_float_dtype
from ._random_init import hf_tensor_shapes, random_hf_tensors

__all__ = ["num_experts_of", "program_table", "LayerPrograms", "ModelStep", "PER_LAYER_JIT_CHOICES",
           "QuantizedTensors", "attention_table", "cache_dims", "check_quantization_config", "checkpoint_layout",
           "decoder_layer", "embed", "head", "hf_tensor_shapes", "load_params", "mlp_prefix", "moe_hidden_size",
           "random_hf_tensors", "stored_float_dtype", "AttnContext", "CausalLM", "DecoderSpec", "FAMILIES",
           "MemoryReport", "context_from_mask", "forward", "from_pretrained", "hf_moe_block", "hf_moe_block_tensors",
           "memory_report", "moe_layer_indices", "save_pretrained", "spec_from_config"]
