"""The analytic roofline of a step: the FLOPs and HBM bytes one device cannot avoid, from the model's config and
the shapes of the program's weights (`weights.AbstractModel`), and the time floor they imply on a device.

    r = roofline(model, "decode", batch=1, seq=4096, hw=HARDWARE["h100"])
    r["step_seconds_floor"], r["bound"], r["flops"], r["bytes"]    # per device

Why analytic: XLA's own cost analysis does not measure this. The GPU compiler gives none, and the host's HLO cost
analysis of a GPU program counts the project's Triton kernels (custom calls) as 0 FLOPs; XLA:TPU's bytes count
traffic a roofline should not (4.2e13 bytes for one gpt-oss-20b decode step). Those numbers stay in the report
as `xla_cost`, for reference only.

Terms (T: tokens through the decoder layers; per device, see "Per device" below):
- matmul FLOPs: 2 x T x (the logical parameters of every matrix of a layer that each token uses: attention
  projections, dense MLPs, routers, shared experts) + 2 x T x min(k, E) x (one routed expert's matrix
  parameters) per MoE layer + 2 x T_head x the LM head (T_head: B rows for serving, whose prefill computes
  logits at the last prompt token only; B x S in training). The embedding is a gather: 0 FLOPs.
- attention FLOPs: 2 x H x (d_qk + d_v) per (query, key) pair and layer; pairs: a decode step's query sees
  min(S, window) keys; a prompt / training row of S tokens sum_{i=1..S} min(i, window) (causal; window: the
  layer's sliding window, else S). GQA: d_qk = d_v = head_dim. MLA with the latent cache (serving: absorbed
  kv_b_proj) d_qk = kv_lora_rank + qk_rope_head_dim, d_v = kv_lora_rank; MLA in training (decompressed keys)
  d_qk = qk_nope_head_dim + qk_rope_head_dim, d_v = v_head_dim.
- weight bytes, in their stored format (packed MXFP4 / NVFP4 / FP8 blocks with their scales; float weights
  in the model dtype): every dense weight once; the embedding's T rows (or the whole table, if fewer rows);
  of each MoE layer's routed experts, the ones the step can touch: min(E, T x min(k, E)) experts.
- KV cache bytes (serving): a decode step reads min(S, window) slots of each layer's cache and writes one;
  a prefill writes S slots per row. Activations are not counted (negligible for decode; a prefill is
  compute-bound). Training keeps no cache.
- training: FLOPs = 3 x the forward's (forward + backward; the programs' block rematerialization, a second
  forward, is not counted: the floor is the work the step needs, not the work the program does); bytes = the
  weights the forward touches read twice (forward, backward) + every weight's gradient written and read + every
  weight read and written by the AdamW update + its moments read and written.

Per device: the mesh split the program uses. Tokens are replicated (every device runs the dense layers and
attention on all of them: expert-sliced serving), so dense FLOPs and bytes are whole per device unless the dense
weights are split (`shard_dense`: then each weight's FLOPs and bytes are divided as its shard is, the best case).
Routed experts are split over the expert axis (w devices): FLOPs / w, and ceil(min(E, T x k) / w) experts read
per device (the touched experts spread as evenly as possible). The KV cache is replicated: whole per device.

floor = max(flops / peak bf16 FLOP/s, bytes / HBM bytes/s); bound: whichever term is larger. Collectives
(one psum of [T, M] per MoE layer in expert-sliced serving) are not in the floor.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from .. import quant
from ..models import cache_dims
from ._hardware import Hardware
from ._weights import AbstractModel, per_device_bytes
from ..validation import check_choice

__all__ = ["roofline", "causal_pairs", "TRAIN_FLOPS_FACTOR", "PROGRAMS"]

#: forward + backward (the backward's two matmuls per forward matmul: d input and d weight)
TRAIN_FLOPS_FACTOR = 3
PROGRAMS = ("prefill", "decode", "train")


def causal_pairs(seq: int, window: int | None) -> int:
    """(query, key) pairs of one causal row of `seq` tokens: sum_{i=1..seq} min(i, window)."""
    w = seq if window is None else min(window, seq)
    return w * (w + 1) // 2 + (seq - w) * w


def _global_bytes(tree: Any) -> int:
    return int(sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(tree)))


def _leaves(tree: Any) -> list:
    """Weights with quantized containers kept whole (their logical shape is the matrix's)."""
    return jax.tree_util.tree_leaves(tree, is_leaf=quant.is_quantized)


def _dense(tree: Any) -> tuple[int, float]:
    """(bytes, matmul parameters) one device holds / multiplies per token of a tree of non-expert weights: every
    leaf's stored bytes; the logical size of every matrix (2-D or more), scaled by the fraction of it the
    device holds (1 when replicated)."""
    nbytes, params = 0, 0.0
    for w in _leaves(tree):
        b, g = per_device_bytes(w), _global_bytes(w)
        nbytes += b
        shape = quant.logical_shape(w)
        if len(shape) >= 2 and g:
            params += math.prod(shape) * b / g
    return nbytes, params


def _expert(tree: Any, experts: int) -> tuple[float, int]:
    """(stored bytes, matmul parameters) of one routed expert of a stacked [E, ...] tree: biases and scales
    included in the bytes; matrices (2-D or more per expert) in the parameters."""
    params = sum(math.prod(quant.logical_shape(w)[1:]) for w in _leaves(tree)
                 if len(quant.logical_shape(w)) >= 3)
    return _global_bytes(tree) / experts, params


def _attention_dims(model: AbstractModel, cached: bool) -> tuple[int, int]:
    """(d_qk, d_v) per query head of the attention's two products (see the module docstring)."""
    m = model.spec.mla
    if m is None:
        return model.spec.head_dim, model.spec.head_dim
    if cached:
        return m.kv_lora_rank + m.qk_rope_dim, m.kv_lora_rank
    return m.qk_nope_dim + m.qk_rope_dim, m.v_dim


def _top(params: dict) -> dict:
    """The head program's weights: final norm and LM head (the embedding table when tied)."""
    top = {k: params[k] for k in ("norm", "lm_head") if k in params}
    if "lm_head" not in top:
        top["embed"] = params["embed"]
    return top


def roofline(model: AbstractModel, program: str, batch: int, seq: int, hw: Hardware,
             optimizer_bytes: int = 0) -> dict:
    """The analytic roofline of one step of `program` ('prefill': B prompts of `seq` tokens; 'decode': one token
    per row against `seq` cached positions; 'train': B rows of `seq` tokens) for one device of `model.mesh`.
    `optimizer_bytes`: the optimizer state one device holds (training). Returns {step_seconds_floor, bound,
    flops, bytes, tokens, tokens_per_second_ceiling, compute_seconds, memory_seconds, flops_terms, bytes_terms,
    routed_experts_read_per_layer, source: 'analytic'}; the terms are those of the module docstring."""
    check_choice(program, "program", PROGRAMS)
    spec, params = model.spec, model.params
    train = program == "train"
    tokens = batch if program == "decode" else batch * seq
    head_tokens = batch if program in ("prefill", "decode") else tokens
    w = model.mesh.shape[model.expert_axis]
    itemsize = jnp.dtype(model.dtype).itemsize
    d_qk, d_v = _attention_dims(model, cached=not train)
    cache_heads, cache_dk, cache_dv = cache_dims(spec)

    dense_params = 0.0
    dense_bytes = expert_bytes = kv_bytes = 0
    expert_flops = attention_flops = 0.0
    experts_read: list[int] = []
    for i, layer in enumerate(params["layers"]):
        moe = layer.get("moe")
        rest = {k: v for k, v in layer.items() if k != "moe"}
        if moe is not None:
            rest["moe"] = {k: v for k, v in moe.items() if k != "experts"}  # router, shared experts
            E = int(jax.tree_util.tree_leaves(moe["experts"])[0].shape[0])
            k = min(int(model.moe_configs[i].gates[0].k), E)
            per_expert_bytes, per_expert_params = _expert(moe["experts"], E)
            touched = math.ceil(min(E, tokens * k) / w)
            experts_read.append(touched)
            expert_bytes += touched * per_expert_bytes
            expert_flops += 2 * tokens * k * per_expert_params / w
        b, p = _dense(rest)
        dense_bytes += b
        dense_params += p
        window = spec.windows[i]
        if program == "decode":
            keys = seq if window is None else min(seq, window)
            pairs = batch * keys
            kv_bytes += batch * cache_heads * (cache_dk + cache_dv) * itemsize * (keys + 1)
        else:
            pairs = batch * causal_pairs(seq, window)
            if program == "prefill":
                kv_bytes += batch * cache_heads * (cache_dk + cache_dv) * itemsize * seq
        attention_flops += 2 * spec.num_heads * (d_qk + d_v) * pairs

    head_bytes, head_params = _dense(_top(params))
    vocab = params["embed"].shape[0]
    embed_bytes = per_device_bytes(params["embed"]) * min(vocab, tokens) / vocab
    forward_flops = {"dense_matmuls": 2 * tokens * dense_params, "routed_experts": expert_flops,
                     "attention": float(attention_flops), "head": 2 * head_tokens * head_params}
    weights_read = dense_bytes + expert_bytes + head_bytes + embed_bytes
    if train:
        flops_terms = {k: TRAIN_FLOPS_FACTOR * v for k, v in forward_flops.items()}
        every_weight = per_device_bytes(params)
        bytes_terms = {"weights_forward_and_backward": 2 * weights_read,
                       "gradients_written_and_read": 2 * every_weight,
                       "weights_updated": 2 * every_weight,
                       "optimizer_state_read_and_written": 2 * optimizer_bytes}
    else:
        flops_terms = forward_flops
        bytes_terms = {"dense_weights": dense_bytes, "routed_experts": expert_bytes, "head": head_bytes,
                       "embedding_rows": embed_bytes, "kv_cache": kv_bytes}
    flops = float(sum(flops_terms.values()))
    nbytes = float(sum(bytes_terms.values()))
    compute, memory = flops / hw.peak_bf16_flops, nbytes / hw.hbm_bytes_per_s
    floor = max(compute, memory)
    return {"source": "analytic", "step_seconds_floor": floor, "bound": "compute" if compute >= memory else "memory",
            "flops": flops, "bytes": nbytes, "tokens": tokens,
            "tokens_per_second_ceiling": tokens / floor if floor > 0 else float("inf"),
            "compute_seconds": compute, "memory_seconds": memory,
            "flops_terms": flops_terms, "bytes_terms": {k: float(v) for k, v in bytes_terms.items()},
            "routed_experts_read_per_layer": max(experts_read, default=0)}
