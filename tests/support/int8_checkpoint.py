"""A compressed-tensors `int-quantized` copy of a float HF checkpoint (the layout llm-compressor writes for
W8A8 / W8A16 int8 models), made with NumPy's own per-channel rounding, and its float twin."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from tutel_jax.checkpoint import open_checkpoint

#: config.json's quantization_config of the copies: per-channel symmetric int8 weights, dynamic activations
INT8_CONFIG = {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
               "config_groups": {"group_0": {"targets": ["Linear"],
                                             "input_activations": {"num_bits": 8, "type": "int", "dynamic": True},
                                             "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                         "strategy": "channel", "dynamic": False}}}}


def write_int8_copy(src: Path, dst: Path, twin: Path | None = None) -> None:
    """Writes into `dst` the checkpoint `src` with every linear `*_proj.weight` stored as I8 [out, in] plus a
    BF16 `weight_scale` [out, 1] (amax / 127 per output row, as released checkpoints store it), the rest float32;
    and into `twin` (if given) a float32 checkpoint of the exact values those tensors stand for."""
    quantized, values = {}, {}
    with open_checkpoint(src) as ckpt:
        for name in ckpt:
            a = np.asarray(ckpt[name], np.float32)
            if not name.endswith("_proj.weight"):
                quantized[name] = values[name] = a
                continue
            amax = np.abs(a).max(axis=1, keepdims=True)
            scale = np.where(amax > 0, amax / 127, 1).astype(ml_dtypes.bfloat16)
            codes = np.clip(np.rint(a / scale.astype(np.float32)), -128, 127).astype(np.int8)
            quantized[name], quantized[name + "_scale"] = codes, scale
            values[name] = codes.astype(np.float32) * scale.astype(np.float32)
    config = {**json.loads((src / "config.json").read_text()), "dtype": "float32", "torch_dtype": "float32"}
    for path, tensors, extra in ((dst, quantized, {"quantization_config": INT8_CONFIG}), (twin, values, {})):
        if path is None:
            continue
        path.mkdir()
        save_file(tensors, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps({**config, **extra}))
