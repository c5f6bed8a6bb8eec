"""The record every quantized weight format fills in (one module per format: `fp8_block`, `mxfp4`, `nvfp4`).

A format is everything the project knows about one way of storing a weight [..., out, in] in fewer bits:

  container         the pytree of packed arrays the library passes around (HF layout [..., out, in]);
                    `.dequantize()` is the JAX reference (float32, bit-identical to `dequantize_numpy`)
  HF checkpoint     `hf_methods` (config.json quant_method values), `hf_formats` (for quant_method
                    "compressed-tensors": the config's `format` values it reads) and `check_hf_config`; `disk_tensors`
                    (which float-layout tensors it stores quantized, as which on-disk tensors: the writer's and
                    the header check's view), `find_parts` (the reader's view: the parts of one weight from the
                    on-disk names) and `from_parts` (a validated container of them, or of ShapeDtypeStructs);
                    `roles` (the safetensors dtypes each part may have); `byte_nonfinite` (the NaN codes of
                    a part stored as uint8, for the checkpoint reader's finite check)
  NumPy reference   `dequantize_numpy` (float32 under the unquantized name, in the float checkpoint's layout)
  quantizer         `quantize` (round to nearest; tests, benchmarks, random init)
  native CPU        `native_args` (the format id of `native/weights.h` and the three arrays the kernels read)
  tile loaders      `triton` (the Pallas Triton grouped matmul's weight-tile loader and operands) and `tpu`
                    (the Mosaic TPU kernel's operands, per-tile accumulation and VMEM estimate)

Adding a format is one module that builds a `QuantFormat` plus one line in `formats/__init__.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["QuantFormat", "DiskTensor", "WeightParts", "TensorSite", "TpuTiles", "check", "absent"]


@dataclasses.dataclass(frozen=True)
class DiskTensor:
    """One on-disk tensor of a quantized weight: name, safetensors dtype code, shape and role (`roles`)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    role: str


@dataclasses.dataclass(frozen=True)
class WeightParts:
    """The on-disk tensors of one quantized weight: `base` is the unquantized name the loaders see, `names` the
    parts in `from_parts`' order, `hidden` what a checkpoint view hides (the parts and unused extras), `variant`
    a sub-convention of the format (NVFP4: "modelopt", whose global scale multiplies)."""

    base: str
    names: tuple[str, ...]
    hidden: tuple[str, ...]
    variant: str = ""


@dataclasses.dataclass(frozen=True)
class TensorSite:
    """A tensor of the float checkpoint layout that a format may store quantized: its name and float shape,
    whether it is a linear layer's weight [out, in] and whether it is a fused expert weight [E, in, out]."""

    name: str
    shape: tuple[int, ...]
    linear: bool
    fused_expert: bool


@dataclasses.dataclass(frozen=True)
class TpuTiles:
    """The Mosaic TPU kernel's per-format pieces (`quant/_pallas_mosaic_tpu.py` runs the schedule).

    operands(x [T, K], w, num_groups, n_dim, k_dim, tm, tn) -> (activation operands, weight operands, their
      BlockSpecs); index maps take (n tile, item, *work list).
    accumulator(w) -> accumulate(refs, expert, tm=, tn=, k_dim=, compute_dtype=, precision=) -> [tm, tn] float32,
      the tile's x @ W.T for weights like `w` (its static fields, e.g. NVFP4's global scale direction).
    vmem(tm, tn, k_dim) -> (weight block bytes, scale block bytes, temporaries) of one grid step.
    check(w) -> None, or raises NotSupported.
    """

    operands: Callable[..., tuple[tuple, tuple, list]]
    accumulator: Callable[[Any], Callable[..., jax.Array]]
    vmem: Callable[[int, int, int], tuple[int, int, int]]
    check: Callable[[Any], None]


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """One quantized weight format (module docstring)."""

    name: str
    container: type
    hf_methods: tuple[str, ...]
    hf_formats: tuple[str, ...]
    check_hf_config: Callable[[Mapping[str, Any]], None]
    roles: Mapping[str, tuple[str, ...]]
    disk_tensors: Callable[[TensorSite, Mapping[str, Any]], list[DiskTensor] | None]
    find_parts: Callable[[str, Collection[str]], WeightParts | None]
    from_parts: Callable[[WeightParts, Sequence[Any], Mapping[str, Any]], Any]
    dequantize_numpy: Callable[[WeightParts, Sequence[np.ndarray], Mapping[str, Any]], np.ndarray]
    #: on-disk name of a uint8 tensor -> (test, bits, description) of its non-finite codes, or None: test
    #: 'equal' (x == bits) or 'mask' (x & bits == bits)
    byte_nonfinite: Callable[[str], tuple[str, int, str] | None]
    quantize: Callable[[jax.Array], Any]
    native_args: Callable[[Any], tuple[int, jax.Array, jax.Array, jax.Array]]
    #: whether the native CPU kernels multiply it by int8 activations on request (E2M1 codes: q8_rows.h)
    native_int8: bool
    triton: Callable[[Any, int, bool], tuple[Any, tuple, int, int]]
    tpu: TpuTiles


def check(cond: bool, msg: str) -> None:
    """ValueError(msg) unless cond (the checkpoint readers' shape and dtype checks)."""
    if not cond:
        raise ValueError(msg)


def absent() -> jax.Array:
    """The native kernels' placeholder for an input a format does not have (scale, global scale)."""
    return jnp.zeros((0,), jnp.float32)
