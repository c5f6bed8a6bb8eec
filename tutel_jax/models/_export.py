"""Export a float CausalLM back to a Hugging Face checkpoint directory (config.json + model.safetensors).

The inverse of `from_pretrained`'s name tables: the written tensors carry the on-disk names and layouts the
model was read from, so HF transformers (and `from_pretrained`) load the directory again. Files are written to a
temporary name in the target directory and renamed into place: an interrupted export leaves no partial file.
Quantized models are refused (export writes float weights only).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import jax
import numpy as np
import safetensors.numpy

from .. import quant
from ..experts import xla_weight
from ..native import CompactBf16
from ._hf_tables import attention_table, mlp_prefix
from ._moe_block import hf_moe_block_tensors
from ._param_layout import to_disk

__all__ = ["hf_tensors", "save_pretrained"]


def hf_tensors(model: Any) -> dict[str, np.ndarray]:
    """{on-disk name: NumPy array} of a float CausalLM (the model's dtype)."""
    # compact bfloat16 weights (the CPU decode layout) as the bfloat16 arrays they hold
    params = jax.tree_util.tree_map(xla_weight, model.params, is_leaf=lambda a: isinstance(a, CompactBf16))
    spec = model.spec
    if any(quant.is_quantized(w) for w in jax.tree_util.tree_leaves(params,
                                                                            is_leaf=quant.is_quantized)):
        raise ValueError("export writes float checkpoints only; this model holds quantized weights "
                         "(load it with from_pretrained(..., dequantize=True) to export float weights)")
    arr = lambda a: np.asarray(a)
    out = {"model.embed_tokens.weight": arr(params["embed"]), "model.norm.weight": arr(params["norm"])}
    if "lm_head" in params:
        out["lm_head.weight"] = arr(params["lm_head"])  # [V, M], as stored
    attn = attention_table(spec)
    for i, lp in enumerate(params["layers"]):
        p = f"model.layers.{i}."
        on_disk = to_disk(lp["attn"], spec)
        out.update({p + "self_attn." + disk: on_disk[ours] for ours, disk in attn.items()})
        out[p + "input_layernorm.weight"] = arr(lp["input_layernorm"])
        out[p + "post_attention_layernorm.weight"] = arr(lp["post_attention_layernorm"])
        if "moe" in lp:
            out.update(hf_moe_block_tensors(lp["moe"], model.config, i))
        else:
            out.update({f"{p}{mlp_prefix(spec)}{k}.weight": arr(v) for k, v in lp["mlp"].items()})
    return out


def _write_atomically(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_pretrained(model: Any, path: str | os.PathLike) -> Path:
    """Writes `config.json` and `model.safetensors` of a float CausalLM into directory `path` (created if needed;
    existing files of those names are replaced atomically). Returns the directory."""

    tensors = hf_tensors(model)  # validates before anything is written
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in model.config.items() if k != "quantization_config"}
    _write_atomically(path / "model.safetensors",
                      lambda tmp: safetensors.numpy.save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, tmp,
                                            metadata={"format": "pt"}))
    _write_atomically(path / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(config, indent=2) + "\n"))
    return path
