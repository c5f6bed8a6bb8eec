"""What the offline compile builds: every kernel at the shapes users run, plus every tiling the tables hold.

Two kinds of cases, each a function and abstract arguments (`jax.ShapeDtypeStruct`, no data):
- model cases: the MoE layer's kernels at the widths of four real model families, for decode (8 tokens) and for
  prefill / training (2048 tokens): the family's router through the gating kernel, dispatch and combine with
  their gradients, the experts' grouped matmuls (forward, and backward for the float families) or the quantized
  grouped matmul of the family's checkpoint format, and a quantized dense decode matmul. Tilings are the
  defaults, chosen for the target being exported for.
- tiling cases: each tiling a selection table can pick for a target (`tiling_candidates`), forced through the
  `config=` argument at a small shape, so a tiling that only a rare shape selects is compiled as well.

| family | hidden | experts | top-k | expert width | router | expert weights |
|---|---|---|---|---|---|---|
| DeepSeek-V3 | 7168 | 256 | 8 | 2048 | sigmoid + bias, 8 groups, top-4 groups | FP8 block |
| GPT-OSS-20B | 2880 | 32 | 4 | 2880 | softmax | MXFP4 |
| Mixtral-8x7B | 4096 | 8 | 2 | 14336 | softmax | bf16 (trained: with gradients) |
| Qwen3-30B-A3B | 2048 | 128 | 8 | 768 | softmax | NVFP4 (compressed-tensors and ModelOpt) |
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from .. import dispatch, quant
from ..gating import gating
from ..gating import tiling_candidates as gating_tilings
from ..gmm import gmm, tgmm
from ..gmm import tiling_candidates as gmm_tilings
from ..quant import quant_gmm, quant_matmul
from ..quant import tiling_candidates as quant_tilings
from ..targets import get_target

__all__ = ["Case", "ModelFamily", "FAMILIES", "model_cases", "tiling_cases", "all_cases"]

SDS = jax.ShapeDtypeStruct
F32, BF16, I32 = jnp.float32, jnp.bfloat16, jnp.int32
DECODE_TOKENS, PREFILL_TOKENS = 8, 2048


@dataclasses.dataclass(frozen=True)
class Case:
    """One exported function: `fn(*args)` with abstract args; `kernels` is how many Triton calls it holds."""

    name: str
    fn: Callable[..., Any]
    args: tuple
    kernels: int


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    name: str
    hidden: int
    experts: int
    top_k: int
    expert_width: int
    router: str  # "softmax" or "sigmoid_grouped"
    weight_format: str | None  # None: bf16 experts (trained), else the checkpoint's quantized format


FAMILIES = (
    ModelFamily("deepseek_v3", 7168, 256, 8, 2048, "sigmoid_grouped", "fp8_block"),
    ModelFamily("gpt_oss_20b", 2880, 32, 4, 2880, "softmax", "mxfp4"),
    ModelFamily("mixtral_8x7b", 4096, 8, 2, 14336, "softmax", None),
    ModelFamily("qwen3_30b_a3b", 2048, 128, 8, 768, "softmax", "nvfp4"),
)


def _quantized(weight_format: str, shape: tuple[int, ...]) -> Any:
    """Abstract quantized weight of logical shape [..., out, in]."""
    if weight_format == "nvfp4_modelopt":
        w = jax.eval_shape(quant.quantize_nvfp4, SDS(shape, F32))
        return type(w)(w.packed, w.scale, w.global_scale, True)
    return jax.eval_shape(quant.FORMATS[weight_format].quantize, SDS(shape, F32))


def _router(family: ModelFamily, tokens: int) -> Case:
    e = family.experts
    if family.router == "sigmoid_grouped":
        fn = lambda logits, bias: gating(logits, family.top_k, score_fn="sigmoid", correction_bias=bias,
                                                n_group=8, topk_group=4, implementation="pallas")
        return Case("gating", fn, (SDS((tokens, e), F32), SDS((e,), F32)), 2)
    fn = lambda logits: gating(logits, family.top_k, implementation="pallas")
    return Case("gating", fn, (SDS((tokens, e), BF16),), 2)


def _dispatch(family: ModelFamily, tokens: int) -> list[Case]:
    k, m = family.top_k, family.hidden
    slots = SDS((k, tokens), I32)
    num_slots = k * tokens  # the dropless layout: one row per assignment
    x, w = SDS((tokens, m), BF16), SDS((k, tokens), F32)
    encode = lambda x, w, s: dispatch.encode(x, w, s, num_slots, implementation="pallas")
    decode = lambda d, w, s: dispatch.decode(d, w, s, implementation="pallas")
    encode_grad = lambda x, w, s: jax.grad(lambda x, w: jnp.sum(encode(x, w, s).astype(F32)), (0, 1))(x, w)
    decode_grad = lambda d, w, s: jax.grad(lambda d, w: jnp.sum(decode(d, w, s).astype(F32)), (0, 1))(d, w)
    data = SDS((num_slots, m), BF16)
    return [Case("encode", encode, (x, w, slots), 1), Case("decode", decode, (data, w, slots), 1),
            Case("encode_vjp", encode_grad, (x, w, slots), 2), Case("decode_vjp", decode_grad, (data, w, slots), 2)]


def _experts(family: ModelFamily, tokens: int, training: bool) -> list[Case]:
    rows, e, m, i = family.top_k * tokens, family.experts, family.hidden, family.expert_width
    sizes = SDS((e,), I32)
    if family.weight_format is None:
        run = lambda x, w, g: gmm(x, w, g, implementation="pallas")
        cases = [Case("gmm_gate_up", run, (SDS((rows, m), BF16), SDS((e, m, 2 * i), BF16), sizes), 1),
                 Case("gmm_down", run, (SDS((rows, i), BF16), SDS((e, i, m), BF16), sizes), 1)]
        if training:
            grad = lambda x, w, g: jax.grad(lambda x, w: jnp.sum(run(x, w, g).astype(F32)), (0, 1))(x, w)
            cases += [Case("gmm_gate_up_vjp", grad, (SDS((rows, m), BF16), SDS((e, m, 2 * i), BF16), sizes), 2),
                      Case("gmm_down_vjp", grad, (SDS((rows, i), BF16), SDS((e, i, m), BF16), sizes), 2)]
        return cases
    formats = [family.weight_format] + (["nvfp4_modelopt"] if family.weight_format == "nvfp4" else [])
    run = lambda x, w, g: quant_gmm(x, w, g, implementation="pallas")
    cases = []
    for fmt in formats:
        cases += [Case(f"quant_gmm_{fmt}_gate_up", run, (SDS((rows, m), BF16), _quantized(fmt, (e, 2 * i, m)), sizes), 1),
                  Case(f"quant_gmm_{fmt}_down", run, (SDS((rows, i), BF16), _quantized(fmt, (e, m, i)), sizes), 1)]
    return cases


def model_cases(family: ModelFamily) -> list[Case]:
    """The kernels of one MoE layer of `family` at decode and prefill sizes (names `family/regime/kernel`)."""
    cases = []
    for regime, tokens in (("decode", DECODE_TOKENS), ("prefill", PREFILL_TOKENS)):
        per = [_router(family, tokens), *_dispatch(family, tokens),
               *_experts(family, tokens, training=regime == "prefill")]
        if family.weight_format is not None and regime == "decode":  # a dense projection of the same format
            fn = lambda x, w: quant_matmul(x, w, implementation="pallas")
            per.append(Case(f"quant_matmul_{family.weight_format}", fn,
                            (SDS((tokens, family.hidden), BF16),
                             _quantized(family.weight_format, (family.hidden, family.hidden))), 1))
        cases += [dataclasses.replace(c, name=f"{family.name}/{regime}/{c.name}") for c in per]
    return cases


def tiling_cases(target: str) -> list[Case]:
    """Each tiling the tables of `target` can select, forced at a small shape (names `tiling/op/label`)."""
    get_target(target)
    cases = []
    sizes = SDS((8,), I32)
    for label, cfg in gmm_tilings(target, "gmm").items():
        dtype = F32 if label.startswith("f32") else BF16
        fn = lambda a, b, g, cfg=cfg: gmm(a, b, g, implementation="pallas", config=cfg)
        cases.append(Case(f"tiling/gmm/{label}", fn, (SDS((512, 512), dtype), SDS((8, 512, 384), dtype), sizes), 1))
    for label, cfg in gmm_tilings(target, "tgmm").items():
        dtype = F32 if label.startswith("f32") else BF16
        fn = lambda a, b, g, cfg=cfg: tgmm(a, b, g, implementation="pallas", config=cfg)
        cases.append(Case(f"tiling/tgmm/{label}", fn, (SDS((512, 512), dtype), SDS((512, 384), dtype), sizes), 1))
    for label, cfg in quant_tilings(target).items():
        dtype = F32 if "f32" in label else BF16
        for fmt in (*quant.FORMATS, "nvfp4_modelopt"):
            fn = lambda x, w, g, cfg=cfg: quant_gmm(x, w, g, implementation="pallas", config=cfg)
            cases.append(Case(f"tiling/quant_gmm_{fmt}/{label}", fn,
                              (SDS((512, 512), dtype), _quantized(fmt, (8, 384, 512)), sizes), 1))
    for label, cfg in gating_tilings(target).items():
        experts = int(label.split("_e")[-1])
        if label.startswith("grouped"):
            fn = lambda l, b, cfg=cfg: gating(l, 8, score_fn="sigmoid", correction_bias=b, n_group=8,
                                                     topk_group=4, implementation="pallas", config=cfg)
            args = (SDS((512, experts), F32), SDS((experts,), F32))
        else:
            fn = lambda l, cfg=cfg: gating(l, 8, implementation="pallas", config=cfg)
            args = (SDS((512, experts), BF16),)
        cases.append(Case(f"tiling/gating/{label}", fn, args, 2))
    return cases


def all_cases(target: str) -> list[Case]:
    """Model cases of every family, then the tiling cases of `target`."""
    return [c for family in FAMILIES for c in model_cases(family)] + tiling_cases(target)
