"""How a CausalLM holds its dense weights in memory, and the way back to the HF on-disk layout.

A linear weight is [out, in] in memory as on disk (HF), float or a quantized container (`tutel_jax.quant._weights`):
one layout that `layers.linear` takes either way, loaded without a transpose, and the layout a small-batch decode
step streams fastest (each output one contiguous row). The GQA attention's float q/k/v weights are one fused
`qkv_proj` [(Hq + 2 Hkv) D, M] (with `qkv_bias` when the family has q/k/v biases): one call per layer instead of
three. Quantized containers are never fused.

`to_memory` / `to_disk` convert one layer's attention dict; `compact_bf16_weights` puts a bfloat16 model's dense
weights in the CPU decode layout (`native.CompactBf16`: the same values in 12 bits); `absorbed_mla_weights` adds
an MLA model's absorbed kv_b_proj halves, the per-head weights its decode step multiplies by.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import quant
from ..core import empty_aligned, usable_cpus
from ..native import compact_bf16
from ._spec import DecoderSpec

__all__ = ["absorbed_mla_weights", "compact_bf16_weights", "qkv_sizes", "to_memory", "to_disk"]

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


def compact_bf16_weights(params: dict) -> dict:
    """A bfloat16 model's dense linear weights in the CPU decode layout, in place: the attention projections, the
    dense MLPs and an untied lm_head as `native.CompactBf16` (the same values in 12 bits per element, 3/4 of the
    bytes a decode step reads; weights it does not apply to stay as they are), encoded on every CPU at once (the
    encoder releases the GIL). Each weight's patch lists are padded to the longest over the layers, so that layers
    of one kind keep one shape (`layer_programs`: one program for them all). Each bfloat16 array is dropped as soon
    as its compact form exists. Returns params."""
    sites = [(lp[part], part, name) for lp in params["layers"] for part in ("attn", "mlp")
             for name in lp.get(part, {}) if name.endswith("_proj")]
    if "lm_head" in params:
        sites.insert(0, (params, "", "lm_head"))  # the largest first: the other workers take the layers meanwhile

    def encode(site):
        holder, _, name = site
        compact = compact_bf16(holder[name])
        if compact is not None:
            holder[name] = compact
        return compact is not None

    with concurrent.futures.ThreadPoolExecutor(max_workers=usable_cpus()) as pool:
        done = list(pool.map(encode, sites))
    layers_of: dict[tuple[str, str], list[dict]] = {}  # (part, weight) -> the dicts holding it compact
    for (holder, part, name), ok in zip(sites, done):
        if ok and part:
            layers_of.setdefault((part, name), []).append(holder)
    for (_, name), holders in layers_of.items():
        count = max(h[name].patches.shape[0] for h in holders)
        for h in holders:
            h[name] = h[name].with_patch_capacity(count)
    return params


#: the absorbed halves of an MLA layer's kv_b_proj (`absorbed_mla_weights`), by attention key
ABSORBED_K, ABSORBED_V = "kv_b_absorbed_k", "kv_b_absorbed_v"


def absorbed_mla_weights(params: dict, spec: DecoderSpec, dtype: Any) -> dict:
    """An MLA model's decode layout, in place: beside each layer's kv_b_proj [H*(nope+v), kv_lora] (float or
    packed), its halves as `dtype` stacks of heads, [out, in] per head: ABSORBED_K = W_UK^T [H, kv_lora, nope] (the
    query's absorption) and ABSORBED_V = W_UV [H, v, kv_lora] (the output's); see `mla_attention`. The values are
    the ones that attention computed from kv_b_proj at every step before (dequantized, cast to `dtype`); a decode
    step now reads them as they are (a few rows: the native kernel, one call for all heads). kv_b_proj stays for
    the paths without a cache and for export. Returns params."""
    m = spec.mla
    for lp in params["layers"]:
        attn = lp["attn"]
        if "kv_b_proj" not in attn:
            continue
        w = np.asarray(quant.dequantize(attn["kv_b_proj"], jnp.float32))
        w = w.reshape(spec.num_heads, m.qk_nope_dim + m.v_dim, m.kv_lora_rank)
        attn[ABSORBED_K] = _device_array(w[:, :m.qk_nope_dim].transpose(0, 2, 1), dtype)
        attn[ABSORBED_V] = _device_array(w[:, m.qk_nope_dim:], dtype)
    return params


def _device_array(a: np.ndarray, dtype: Any) -> jax.Array:
    """`a` cast to `dtype` as a jax array, through one aligned host copy (on CPU the array then uses that memory, no
    second copy; a NumPy argument would be transferred at every call)."""
    out = empty_aligned(a.shape, jnp.dtype(dtype))
    out[...] = a
    return jax.device_put(out)
