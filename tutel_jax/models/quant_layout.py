"""The on-disk tensor layout of a quantized HF checkpoint: names, safetensors dtypes and shapes, from config.json.

The inverse of `dequant.QuantizedTensors`' naming (formats: see `models.dequant`), built on the float layout of
`random_init.hf_tensor_shapes`:

  fp8 (DeepSeek)          every linear `*_proj*.weight` [out, in] -> F8_E4M3 [out, in]
                          + `weight_scale_inv` F32 [ceil(out/b0), ceil(in/b1)] (b = weight_block_size)
  mxfp4 (GPT-OSS)         the fused expert weights [E, in, out] -> `<w>_blocks` U8 [E, out, in/32, 16]
                          + `<w>_scales` U8 (E8M0) [E, out, in/32]; the rest (modules_to_not_convert) float
  compressed-tensors      every linear `*_proj*.weight` [out, in] not in `ignore` -> `weight_packed` U8 [out, in/2]
  (nvfp4-pack-quantized)  + `weight_scale` F8_E4M3 [out, in/16] + `weight_global_scale` F32 [1]

Float tensors get the config's dtype (`dtype` / `torch_dtype`, default bfloat16), except DeepSeek's
`e_score_correction_bias` (float32, as HF stores it). Each tensor comes with its role, which says what its
values are: 'normal' / 'ones' / 'zeros' (float weights as HF initialises them), 'fp4' (packed E2M1 pairs),
'e8m0' (MXFP4 block exponents), 'fp8' (e4m3 weights), 'scale_inv' (FP8 block scales), 'e4m3_scale' (NVFP4
block scales) and 'global_scale' (NVFP4 per-tensor scale).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from ..checkpoint.safetensors_io import DTYPE_BITS
from ..checkpoint.safetensors_write import TensorInfo
from .families import family_of
from .hf_tables import implied_tensor_count
from .moe_block import _num_experts
from .random_init import _init_kind, hf_tensor_shapes
from .spec import spec_from_config

__all__ = ["ROLES", "ALLOWED_DTYPES", "float_dtype_code", "checkpoint_layout", "check_checkpoint_header"]

ROLES = ("normal", "ones", "zeros", "fp4", "e8m0", "fp8", "scale_inv", "e4m3_scale", "global_scale")
_LINEAR = re.compile(r"_proj[a-z_]*\.weight$")  # q_proj, kv_a_proj_with_mqa, experts' down_proj, ...
_FLOAT_CODES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def float_dtype_code(config: Mapping[str, Any]) -> str:
    """The safetensors dtype code of the checkpoint's float tensors (config `dtype` / `torch_dtype`)."""
    name = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16").removeprefix("torch.")
    if name not in _FLOAT_CODES:
        raise ValueError(f"config dtype {name!r} is not a checkpoint float dtype (expected one of {sorted(_FLOAT_CODES)})")
    return _FLOAT_CODES[name]


def _ignored(module: str, patterns: list[str]) -> bool:
    """compressed-tensors' `ignore`: exact module names, or `re:<regex>` matched against the module name."""
    return any(re.fullmatch(p[3:], module) if p.startswith("re:") else p == module for p in patterns)


def _divisible(name: str, size: int, by: int, what: str) -> int:
    if size % by:
        raise ValueError(f"tensor {name!r}: input width {size} is not a multiple of the {what} block {by}")
    return size // by


def checkpoint_layout(config: Mapping[str, Any]) -> list[tuple[TensorInfo, str]]:
    """[(TensorInfo, role)] of every tensor of an HF checkpoint of `config` (quantized or float), in the float
    layout's order (a quantized weight is followed by its scales). Roles: module docstring.

    Raises ValueError for an unknown model_type, an unsupported quantization method, or widths that the
    format's blocks do not divide (naming the tensor).
    """
    float_code = float_dtype_code(config)
    q = config.get("quantization_config") or {}
    method = q.get("quant_method") if q else None
    if method not in (None, "fp8", "mxfp4", "compressed-tensors"):
        raise ValueError(f"checkpoint_layout: unsupported quant_method {method!r} (supported: fp8, mxfp4, "
                         "compressed-tensors nvfp4)")
    fused = set(family_of(config).fused_experts or ())
    block = tuple(q.get("weight_block_size", (128, 128))) if method == "fp8" else None
    ignore = list(q.get("ignore", [])) if method == "compressed-tensors" else []
    out: list[tuple[TensorInfo, str]] = []
    for name, shape in hf_tensor_shapes(config).items():
        linear = len(shape) == 2 and _LINEAR.search(name) is not None
        if method == "fp8" and linear:
            out.append((TensorInfo(name, "F8_E4M3", shape), "fp8"))
            grid = (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
            out.append((TensorInfo(name + "_scale_inv", "F32", grid), "scale_inv"))
        elif method == "mxfp4" and name.rsplit(".", 1)[-1] in fused and not name.endswith("_bias"):
            experts, width, outputs = shape  # float layout [E, in, out]
            groups = _divisible(name, width, 32, "MXFP4")
            out.append((TensorInfo(name + "_blocks", "U8", (experts, outputs, groups, 16)), "fp4"))
            out.append((TensorInfo(name + "_scales", "U8", (experts, outputs, groups)), "e8m0"))
        elif method == "compressed-tensors" and linear and not _ignored(name.removesuffix(".weight"), ignore):
            rows, width = shape
            groups = _divisible(name, width, 16, "NVFP4")
            base = name.removesuffix(".weight")
            out.append((TensorInfo(base + ".weight_packed", "U8", (rows, width // 2)), "fp4"))
            out.append((TensorInfo(base + ".weight_scale", "F8_E4M3", (rows, groups)), "e4m3_scale"))
            out.append((TensorInfo(base + ".weight_global_scale", "F32", (1,)), "global_scale"))
        else:
            code = "F32" if name.endswith("e_score_correction_bias") else float_code
            out.append((TensorInfo(name, code, shape), _init_kind(name)))
    return out


_FLOATS = ("F32", "F16", "BF16")
ALLOWED_DTYPES: dict[str, tuple[str, ...]] = {
    "normal": _FLOATS, "ones": _FLOATS, "zeros": _FLOATS, "fp4": ("U8",), "e8m0": ("U8",), "fp8": ("F8_E4M3",),
    "scale_inv": ("F32", "BF16"), "e4m3_scale": ("F8_E4M3", "U8"), "global_scale": ("F32",),
}


def _min_bytes(shape: tuple[int, ...], codes: tuple[str, ...]) -> int:
    """The fewest bytes a tensor of `shape` stored as one of the dtype `codes` takes."""
    return math.prod(shape) * min(DTYPE_BITS[c] for c in codes) // 8


def check_checkpoint_header(checkpoint: Any, config: Mapping[str, Any], where: str = "config") -> None:
    """Checks that `checkpoint` (a `safetensors_io.Checkpoint`: only its headers are read, no tensor data)
    holds the model `config` (config.json, named `where` in errors) describes, before anything is allocated:

      1. the number of tensors the config implies (`hf_tables.implied_tensor_count`, closed form: layers x
         (attention + norms + experts ...)) is at most the number the checkpoint holds;
      2. the bytes the config's tensors take at the least (each tensor in the narrowest dtype its role allows,
         `ALLOWED_DTYPES`) are at most the checkpoint's own tensor bytes;
      3. every tensor of `checkpoint_layout(config)` is present (optional router tensors aside) with a dtype
         of its role and its shape.

    ValueError naming the config (counts, bytes) or the file and the tensor. Configs whose layout is unknown
    (other quantization methods) get checks 1 and 2 only (with the float shapes at 4 bits per value); their
    tensors are left to the loaders.
    """
    spec = spec_from_config(config, where)
    have = len(checkpoint)
    need = implied_tensor_count(spec, config)
    if need > have:
        experts = "" if "moe" not in spec.ffn else f", {_num_experts(config)} experts per MoE layer"
        raise ValueError(f"{where}: the config implies at least {need} tensors ({spec.num_layers} layers"
                         f"{experts}) but the checkpoint holds only {have}")
    optional = {f"model.layers.{i}.{family_of(config).ffn_prefix}{disk}"
                for i in range(spec.num_layers) for disk in family_of(config).optional_router_tensors.values()}
    try:
        layout = checkpoint_layout(config)
        required = [(info, role) for info, role in layout if info.name not in optional]
        need_bytes = sum(_min_bytes(info.shape, ALLOWED_DTYPES[role]) for info, role in required)
    except ValueError:
        layout = None
        need_bytes = sum(math.prod(shape) for name, shape in hf_tensor_shapes(config).items()
                         if name not in optional) // 2
    nbytes = getattr(checkpoint, "nbytes", None)
    if nbytes is not None and need_bytes > nbytes():
        raise ValueError(f"{where}: the config's tensors take at least {need_bytes} bytes (hidden_size "
                         f"{spec.hidden_size}, vocab_size {spec.vocab_size}, {spec.num_layers} layers, ...) but "
                         f"the checkpoint's tensors hold only {nbytes()} bytes")
    if layout is None:
        return
    method = (config.get("quantization_config") or {}).get("quant_method", "float")
    for info, role in required:
        if info.name not in checkpoint:
            raise ValueError(f"{where}: the config implies tensor {info.name!r} {list(info.shape)}, which the "
                             "checkpoint does not hold")
        dtype, shape, path = checkpoint.info(info.name)
        if dtype not in ALLOWED_DTYPES[role]:
            raise ValueError(f"{path}: tensor {info.name!r} is {dtype}, but a {config.get('model_type')} "
                             f"{method} checkpoint stores it as {' or '.join(ALLOWED_DTYPES[role])} ({role})")
        if tuple(shape) != info.shape:
            raise ValueError(f"{path}: tensor {info.name!r} has shape {list(shape)}; the config implies "
                             f"{list(info.shape)}")
    for info, role in layout:  # optional tensors: checked when present
        if info.name in optional and info.name in checkpoint:
            dtype, shape, path = checkpoint.info(info.name)
            if dtype not in ALLOWED_DTYPES[role] or tuple(shape) != info.shape:
                raise ValueError(f"{path}: tensor {info.name!r} is {dtype} {list(shape)}; the config implies "
                                 f"{' or '.join(ALLOWED_DTYPES[role])} {list(info.shape)}")
