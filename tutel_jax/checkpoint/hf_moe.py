"""One MoE block of a Hugging Face checkpoint as a tutel-jax layer: config + parameters.

Supported model_types: `tutel_jax.models.FAMILIES`; each family's tensor names, router and experts layout are
in its own module, `tutel_jax/models/families/<model_type>.py`. The block maps hidden states [..., H] to the
MoE output [..., H] exactly like the HF block (dropless: HF never drops tokens), shared experts included. Read
through `models.dequant.QuantizedTensors`, quantized expert weights stay packed (experts `weight_format`, see
`grouped_linear`). The implementation is `tutel_jax.models.moe_block`; this module keeps its public names.
"""

from __future__ import annotations

import os

import numpy as np

from ..models.moe_block import hf_moe_block, hf_moe_block_tensors, moe_layer_indices
from .safetensors_io import SafetensorsFile

__all__ = ["hf_moe_block", "hf_moe_block_tensors", "moe_layer_indices", "load_safetensors"]


def load_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a safetensors file as NumPy arrays (any dtype, bfloat16 and float8 included; every header
    entry validated before reading; see `safetensors_io`)."""
    with SafetensorsFile(path) as f:
        return {name: f[name] for name in f.keys()}
