"""How a CausalLM holds its dense weights in memory, and the way back to the HF on-disk layout.

A linear weight is [out, in] in memory as on disk (HF), float or a quantized container (`tutel_jax.quant._weights`):
one layout that `layers.linear` takes either way, loaded without a transpose, and the layout a small-batch decode
step streams fastest (each output one contiguous row). The GQA attention's float q/k/v weights are one fused
`qkv_proj` [(Hq + 2 Hkv) D, M] (with `qkv_bias` when the family has q/k/v biases): one call per layer instead of
three. Quantized containers are never fused.

`to_memory` / `to_disk` convert one layer's attention dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import quant
from ._spec import DecoderSpec

__all__ = ["qkv_sizes", "to_memory", "to_disk"]

_QKV = ("q", "k", "v")


def _fusable(spec: DecoderSpec, attn: Mapping[str, Any]) -> bool:
    return spec.mla is None and all(f"{n}_proj" in attn and not quant.is_quantized(attn[f"{n}_proj"])
                                    for n in _QKV)


def to_memory(attn: Mapping[str, Any], spec: DecoderSpec) -> dict[str, Any]:
    """One layer's attention params as read from disk ([out, in] linears, by `hf_tables.attention_table` name)
    -> the in-memory layout: float q/k/v fused into `qkv_proj` (+ `qkv_bias`), everything else as read."""
    out = dict(attn)
    if not _fusable(spec, attn):
        return out
    out["qkv_proj"] = np.concatenate([np.asarray(out.pop(f"{n}_proj")) for n in _QKV], axis=0)
    if "q_bias" in out:
        out["qkv_bias"] = np.concatenate([np.asarray(out.pop(f"{n}_bias")) for n in _QKV])
    return out


def qkv_sizes(spec: DecoderSpec) -> tuple[int, int, int]:
    """Output widths (rows) of q, k, v inside the fused weight."""
    return spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim


def to_disk(attn: Mapping[str, Any], spec: DecoderSpec) -> dict[str, np.ndarray]:
    """Inverse of `to_memory` (float weights): separate q/k/v, as NumPy arrays."""
    attn = {k: np.asarray(v) for k, v in attn.items()}
    if "qkv_proj" in attn:
        splits = np.cumsum(qkv_sizes(spec))[:-1]
        attn.update({f"{n}_proj": w for n, w in zip(_QKV, np.split(attn.pop("qkv_proj"), splits, axis=0))})
        if "qkv_bias" in attn:
            attn.update({f"{n}_bias": b for n, b in zip(_QKV, np.split(attn.pop("qkv_bias"), splits))})
    return {k: np.ascontiguousarray(v) for k, v in attn.items()}
