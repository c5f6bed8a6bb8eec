"""Compressed-tensors copies of a float HF checkpoint with a scale per output channel (the layout llm-compressor
writes for W8A8 / W8A16 models): int8 `int-quantized` or FP8 `float-quantized`, per channel or per tensor, made
with NumPy's own rounding (ml_dtypes' e4m3 cast for FP8), and the float twin of the exact values they stand for."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from tutel_jax.checkpoint import open_checkpoint

#: element -> (compressed-tensors format, weights type, largest code)
ELEMENTS = {"int8": ("int-quantized", "int", 127.0), "fp8": ("float-quantized", "float", 448.0)}


def channel_config(element: str = "int8", strategy: str = "channel") -> dict:
    """config.json's quantization_config of the copies: symmetric 8-bit weights, dynamic activations."""
    fmt, kind, _ = ELEMENTS[element]
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "input_activations": {"num_bits": 8, "type": kind, "dynamic": True},
                                          "weights": {"num_bits": 8, "type": kind, "symmetric": True,
                                                      "strategy": strategy, "dynamic": False}}}}


def _codes(a: np.ndarray, scale: np.ndarray, element: str) -> np.ndarray:
    x = a / scale.astype(np.float32)
    if element == "int8":
        return np.clip(np.rint(x), -128, 127).astype(np.int8)
    return np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn)


def write_channel_copy(src: Path, dst: Path, twin: Path | None = None, element: str = "int8",
                       strategy: str = "channel") -> None:
    """Writes into `dst` the checkpoint `src` with every linear `*_proj.weight` stored as I8 / F8_E4M3 [out, in]
    plus a BF16 `weight_scale` ([out, 1]: amax / top per output row; [1] per tensor), as released checkpoints store
    it, the rest float32; and into `twin` (if given) a float32 checkpoint of the exact values those tensors stand
    for."""
    top = ELEMENTS[element][2]
    quantized, values = {}, {}
    with open_checkpoint(src) as ckpt:
        for name in ckpt:
            a = np.asarray(ckpt[name], np.float32)
            if not name.endswith("_proj.weight"):
                quantized[name] = values[name] = a
                continue
            amax = np.abs(a).max(axis=1, keepdims=True) if strategy == "channel" else np.abs(a).max().reshape(1)
            scale = np.where(amax > 0, amax / top, 1).astype(ml_dtypes.bfloat16)
            codes = _codes(a, scale, element)
            quantized[name], quantized[name + "_scale"] = codes, scale
            values[name] = codes.astype(np.float32) * scale.astype(np.float32)
    config = {**json.loads((src / "config.json").read_text()), "dtype": "float32", "torch_dtype": "float32"}
    q = channel_config(element, strategy)
    for path, tensors, extra in ((dst, quantized, {"quantization_config": q}), (twin, values, {})):
        if path is None:
            continue
        path.mkdir()
        save_file(tensors, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps({**config, **extra}))
