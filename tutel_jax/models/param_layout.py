"""How a CausalLM holds its dense weights in memory, and the way back to the HF on-disk layout.

On disk (HF) a linear weight is [out, in]. In memory a float linear weight is a kernel [in, out]
(`layers.linear` computes `x @ w`), and the GQA attention's q/k/v kernels are one fused `qkv_proj`
[M, (Hq + 2 Hkv) D] (with `qkv_bias` when the family has q/k/v biases): one matmul per layer instead of three,
reading a row-major kernel, which is what a small-batch decode step is bound by. Quantized containers
(`tutel_jax.quant.weights`) keep the on-disk [out, in] blocks and are never fused.

`to_memory` / `to_disk` convert one layer's attention dict; `kernel` / `unkernel` one weight.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..quant import weights as quant_weights
from .spec import DecoderSpec

__all__ = ["kernel", "unkernel", "is_linear", "qkv_sizes", "to_memory", "to_disk"]

_QKV = ("q", "k", "v")


def is_linear(name: str) -> bool:
    """Whether an attention / MLP parameter name is a linear weight (q_proj, kv_a_proj_with_mqa, gate_proj, ...)."""
    return "proj" in name


def kernel(w: Any) -> Any:
    """HF [out, in] -> kernel [in, out] (NumPy, contiguous); quantized containers are returned unchanged."""
    if quant_weights.is_quantized(w):
        return w
    return np.ascontiguousarray(np.swapaxes(np.asarray(w), -1, -2))


def unkernel(w: Any) -> np.ndarray:
    """Kernel [in, out] -> HF [out, in] (NumPy)."""
    return np.ascontiguousarray(np.swapaxes(np.asarray(w), -1, -2))


def _fusable(spec: DecoderSpec, attn: Mapping[str, Any]) -> bool:
    return spec.mla is None and all(f"{n}_proj" in attn and not quant_weights.is_quantized(attn[f"{n}_proj"])
                                    for n in _QKV)


def to_memory(attn: Mapping[str, Any], spec: DecoderSpec) -> dict[str, Any]:
    """One layer's attention params as read from disk ([out, in] linears, by `hf_tables.attention_table` name)
    -> the in-memory layout: float linears as kernels, q/k/v fused into `qkv_proj` (+ `qkv_bias`)."""
    out = {k: kernel(v) if is_linear(k) else v for k, v in attn.items()}
    if not _fusable(spec, attn):
        return out
    out["qkv_proj"] = np.concatenate([out.pop(f"{n}_proj") for n in _QKV], axis=1)
    if "q_bias" in out:
        out["qkv_bias"] = np.concatenate([np.asarray(out.pop(f"{n}_bias")) for n in _QKV])
    return out


def qkv_sizes(spec: DecoderSpec) -> tuple[int, int, int]:
    """Output widths of q, k, v inside the fused kernel."""
    return spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim


def to_disk(attn: Mapping[str, Any], spec: DecoderSpec) -> dict[str, np.ndarray]:
    """Inverse of `to_memory` (float weights): separate q/k/v, [out, in] linears, as NumPy arrays."""
    attn = {k: np.asarray(v) for k, v in attn.items()}
    if "qkv_proj" in attn:
        splits = np.cumsum(qkv_sizes(spec))[:-1]
        attn.update({f"{n}_proj": w for n, w in zip(_QKV, np.split(attn.pop("qkv_proj"), splits, axis=1))})
        if "qkv_bias" in attn:
            attn.update({f"{n}_bias": b for n, b in zip(_QKV, np.split(attn.pop("qkv_bias"), splits))})
    return {k: unkernel(v) if is_linear(k) else v for k, v in attn.items()}
