"""The on-disk tensor layout of a quantized HF checkpoint: names, safetensors dtypes and shapes, from config.json.

The inverse of `dequant.QuantizedTensors`' naming, built on the float layout of `random_init.hf_tensor_shapes`:
the format the config's quant_method names (`pallas_kernels.quant.formats`) says, tensor by tensor, which ones it
stores quantized and as which on-disk tensors (`QuantFormat.disk_tensors`; fp8: every linear, mxfp4: the fused
expert weights, compressed-tensors nvfp4: every linear not in `ignore`).

Float tensors get the config's dtype (`dtype` / `torch_dtype`, default bfloat16), except DeepSeek's
`e_score_correction_bias` (float32, as HF stores it). Each tensor comes with its role, which says what its
values are: 'normal' / 'ones' / 'zeros' (float weights as HF initialises them), or a format's roles ('fp4':
packed E2M1 pairs, 'e8m0': MXFP4 block exponents, 'fp8': e4m3 weights, 'scale_inv': FP8 block scales,
'e4m3_scale': NVFP4 block scales, 'global_scale': NVFP4 per-tensor scale).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from pallas_kernels.quant import FORMATS, format_for_config
from pallas_kernels.quant.formats import TensorSite

from ..checkpoint import DTYPE_BITS, TensorInfo
from .families import family_of
from ._hf_tables import implied_tensor_count
from ._moe_block import num_experts_of
from ._random_init import _init_kind, hf_tensor_shapes
from ._spec import spec_from_config

__all__ = ["ROLES", "ALLOWED_DTYPES", "auto_compute_dtype", "float_dtype_code", "checkpoint_layout",
           "check_checkpoint_header", "stored_float_dtype"]

_FLOATS = ("F32", "F16", "BF16")
#: role -> the safetensors dtypes a tensor of that role may have (float roles, then every format's)
ALLOWED_DTYPES: dict[str, tuple[str, ...]] = {"normal": _FLOATS, "ones": _FLOATS, "zeros": _FLOATS}
for _fmt in FORMATS.values():
    ALLOWED_DTYPES.update(_fmt.roles)
ROLES = tuple(ALLOWED_DTYPES)
_LINEAR = re.compile(r"_proj[a-z_]*\.weight$")  # q_proj, kv_a_proj_with_mqa, experts' down_proj, ...
_FLOAT_CODES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def stored_float_dtype(config: Mapping[str, Any]) -> str:
    """The name of the checkpoint's float dtype ('bfloat16', 'float16' or 'float32': config `dtype` /
    `torch_dtype`, default bfloat16); ValueError for another."""
    name = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16").removeprefix("torch.")
    if name not in _FLOAT_CODES:
        raise ValueError(f"config dtype {name!r} is not a checkpoint float dtype (expected one of {sorted(_FLOAT_CODES)})")
    return name


def auto_compute_dtype(config: Mapping[str, Any]) -> str:
    """`dtype='auto'`: the checkpoint's own float dtype where it is bfloat16 (half the bytes to read per token, the
    native kernels' bfloat16 rows), else float32 (float16 has no fast path on CPUs)."""
    return "bfloat16" if stored_float_dtype(config) == "bfloat16" else "float32"


def float_dtype_code(config: Mapping[str, Any]) -> str:
    """The safetensors dtype code of the checkpoint's float tensors (config `dtype` / `torch_dtype`)."""
    return _FLOAT_CODES[stored_float_dtype(config)]


def checkpoint_layout(config: Mapping[str, Any]) -> list[tuple[TensorInfo, str]]:
    """[(TensorInfo, role)] of every tensor of an HF checkpoint of `config` (quantized or float), in the float
    layout's order (a quantized weight is followed by its scales). Roles: module docstring.

    Raises ValueError for an unknown model_type, an unsupported quantization method, or widths that the
    format's blocks do not divide (naming the tensor).
    """
    float_code = float_dtype_code(config)
    q = config.get("quantization_config") or {}
    fmt = format_for_config(q) if q else None
    if q and fmt is None:
        raise ValueError(f"checkpoint_layout: unsupported quant_method {q.get('quant_method')!r} (supported: "
                         f"{', '.join(m for f in FORMATS.values() for m in f.hf_methods)})")
    fused = set(family_of(config).fused_experts or ())
    out: list[tuple[TensorInfo, str]] = []
    for name, shape in hf_tensor_shapes(config).items():
        site = TensorSite(name, tuple(shape), linear=len(shape) == 2 and _LINEAR.search(name) is not None,
                          fused_expert=name.rsplit(".", 1)[-1] in fused)
        disk = fmt.disk_tensors(site, q) if fmt is not None else None
        if disk is not None:
            out.extend((TensorInfo(t.name, t.dtype, t.shape), t.role) for t in disk)
        else:
            code = "F32" if name.endswith("e_score_correction_bias") else float_code
            out.append((TensorInfo(name, code, shape), _init_kind(name)))
    return out


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
        experts = "" if "moe" not in spec.ffn else f", {num_experts_of(config)} experts per MoE layer"
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
