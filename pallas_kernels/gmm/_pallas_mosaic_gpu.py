"""Grouped matmul on Mosaic GPU kernels (Hopper sm_90, Blackwell sm_100) through tokamax's `ragged_dot`.

    gmm_mosaic_gpu(lhs[T, K], rhs[G, K, N] (or [G, N, K] transposed), group_sizes[G]) -> [T, N]

Semantics are _reference.py's: rows of lhs are sorted by group; rows past sum(group_sizes) give zeros; a group that
extends past T is cut at T. The weight gradient (tgmm) is never run here: tokamax's ragged-contraction kernel
gave wrong results on an H200 (benchmarks/results/mosaic_gpu_gmm_h200.txt), so it stays on Triton.

tokamax (PyPI `tokamax`, an optional dependency: Python >= 3.12, jax >= 0.11.1) ships Pallas Mosaic GPU kernels
for `ragged_dot`: a wgmma kernel for sm_90 with a ragged-contraction (weight-gradient) variant, and a tcgen05
kernel for sm_100 that has the forward form only. This module calls its public `tokamax.ragged_dot_general`
with `implementation="mosaic_gpu"` (tokamax's own tiling: its autotuning cache, else its heuristics; _pallas_triton.py's
`GmmConfig` tilings are Triton's and do not apply) and adapts the semantics around it:

- group sizes are clamped to T first, so no group reaches past the rows that exist;
- rows: Mosaic GPU's TMA tiles need the row count of lhs to be a multiple of 8, so lhs gets zero rows
  appended; the padding lies past the last group;
- rows past the last group: the kernel never writes the row tiles no group owns, so the output is masked to
  zero there (one select, fused with the slice back to T);
- which kernel tokamax builds (sm_90 or sm_100) follows the compute capability of JAX's default device. On the
  GPU itself that is the device. Compiling for another GPU (deviceless, e.g. `jax.set_mesh` of a topology of 8
  H100s on a CPU host), the call is traced under `jax.default_device` of a compile-only device of the target
  (from `jax.experimental.topologies` through JAX's CUDA plugin; see `tutel_jax.compile._topology`). Without
  either, the call is NotSupported. Mosaic GPU keeps one architecture per process when compiling without a
  GPU: a process that compiled for sm_90 cannot also compile for sm_100.

Limits (`check_supported` raises NotSupported, and "auto" moves on to the Triton kernel):
- lhs and rhs both bfloat16 or both float16 (tokamax's limit; float32 runs Triton, which follows
  `jax.default_matmul_precision`); the output bf16 / f16 / float32 on sm_90, the input dtype on sm_100 (a
  float32 output tile does not fit the sm_100 kernel's shared memory at tokamax's tiling);
- K and N multiples of 64 (the 128-byte swizzled tile of 16-bit elements; the TMA descriptors need it);
- on a multi-device mesh every mesh axis of size > 1 must be manual (inside `shard_map`): like Mosaic TPU
  kernels, these are not partitioned by XLA.

Numerics: Mosaic GPU kernels run only on a GPU (Pallas' interpreter does not run them, and tokamax exposes no
interpret mode for them); `benchmarks/gpu_kernels.py` and `benchmarks/mosaic_gpu_gmm.py` check them against
`gmm_reference` on a device.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._manual import require_manual_axes, run_manual
from .._select import MOSAIC_GPU_TARGETS, NotSupported
from ..targets import (Target, _default_device, _mesh_device, compile_only_device, current_target,
                       target_of_device, target_of_kind)
from ._reference import clamp_group_sizes

__all__ = ["MOSAIC_GPU_DTYPES", "DIM_MULTIPLE", "unavailable_reason", "check_supported", "supports",
           "gmm_mosaic_gpu", "compile_device", "mosaic_gpu_unavailable"]

#: input dtypes of tokamax's non-quantized Mosaic GPU kernels (lhs and rhs alike)
MOSAIC_GPU_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
#: K and N must be multiples of this (a 128-byte swizzle tile of 16-bit elements)
DIM_MULTIPLE = 64
#: row padding of lhs (rows are the major dim of a TMA tile)
GMM_ROW_MULTIPLE = 8
#: a named scope around the kernel: its custom call's op name says where it comes from
SCOPE = "tutel_gmm_mosaic_gpu"

_FORWARD = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [1]), ([], [])),
                                         lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
_TRANSPOSED = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                            lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


@functools.lru_cache(maxsize=None)
def _tokamax_import() -> tuple[Any, str | None]:
    """(the tokamax module or None, why not); imported once: it is a large package."""
    try:
        return importlib.import_module("tokamax"), None
    except ImportError as error:
        return None, (f"tokamax is not installed ({error}); the Mosaic GPU grouped matmul needs it: "
                      "pip install tokamax (Python >= 3.12, jax >= 0.11.1)")


def unavailable_reason() -> str | None:
    """Why tokamax's Mosaic GPU ragged_dot cannot be used in this environment, or None when it can."""
    return _tokamax_import()[1]


def mosaic_gpu_unavailable() -> str | None:
    """Why the Mosaic GPU grouped matmul cannot be traced now (tokamax missing, or a target other than sm_90 /
    sm_100), or None when it can be tried (the op's own check still decides per call)."""
    reason = unavailable_reason()
    if reason is not None:
        return reason
    target = current_target().name
    if target not in MOSAIC_GPU_TARGETS:
        return (f"the Mosaic GPU kernels (tokamax) target {' and '.join(MOSAIC_GPU_TARGETS)}; this program is traced "
                f"for {target}")
    return None


def _tokamax() -> Any:
    module, reason = _tokamax_import()
    if module is None:
        raise NotSupported(reason)
    return module


def compile_device(target: Target | None = None) -> jax.Device | None:
    """The device whose compute capability tokamax reads to build the kernel for `target` (default: the current
    one): the default device when it is a GPU of that target, else a compile-only device of the mesh's device
    kind (or the target's own kind); None when there is neither."""
    target = target or current_target()
    default = _default_device()
    if default is not None and default.platform in ("gpu", "cuda") and target_of_device(default) is target:
        return default
    mesh = _mesh_device()
    kinds = [mesh[1]] if mesh is not None and target_of_kind(mesh[1], mesh[0]) is target else []
    for kind in kinds + [target.device_kind]:
        device = compile_only_device(kind)
        if device is not None:
            return device
    return None


def check_supported(lhs_dtype: Any, rhs_dtype: Any, out_dtype: Any, k_dim: int, n_dim: int) -> None:
    """Raises NotSupported unless the Mosaic GPU gmm can run this call (see the module docstring): tokamax and
    an sm_90 / sm_100 target first (`mosaic_gpu_unavailable`), then the call's dtypes and widths.

    Args:
      lhs_dtype, rhs_dtype, out_dtype: the operands' and the output's dtypes.
      k_dim, n_dim: the contraction and output widths.
    """
    reason = mosaic_gpu_unavailable()
    if reason is not None:
        raise NotSupported(reason)
    target = current_target()
    lhs_dtype, rhs_dtype, out_dtype = (jnp.dtype(d) for d in (lhs_dtype, rhs_dtype, out_dtype))
    if lhs_dtype != rhs_dtype or lhs_dtype not in MOSAIC_GPU_DTYPES:
        raise NotSupported(f"the Mosaic GPU grouped matmul takes two bfloat16 or two float16 operands, got "
                           f"{lhs_dtype} and {rhs_dtype}")
    outputs = (lhs_dtype,) if target.name == "sm_100" else MOSAIC_GPU_DTYPES + (jnp.dtype(jnp.float32),)
    if out_dtype not in outputs:
        raise NotSupported(f"the Mosaic GPU grouped matmul for {target.name} writes {[str(d) for d in outputs]}, "
                           f"not {out_dtype}")
    if k_dim % DIM_MULTIPLE or n_dim % DIM_MULTIPLE:
        raise NotSupported(f"the Mosaic GPU grouped matmul needs K and N to be multiples of {DIM_MULTIPLE}, got "
                           f"K={k_dim}, N={n_dim}")
    require_manual_axes("Mosaic GPU")
    if compile_device(target) is None:
        raise NotSupported(f"no {target.name} device to build the Mosaic GPU kernel for: run on such a GPU, or "
                           "compile under jax.set_mesh of its devices with JAX's CUDA plugin installed")


def supports(*args: Any, **kwargs: Any) -> bool:
    """`check_supported` as a bool."""
    try:
        check_supported(*args, **kwargs)
    except NotSupported:
        return False
    return True


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
    return x if x.shape[0] == rows else jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))


def _ragged_dot(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array, dims: lax.RaggedDotDimensionNumbers,
                out_dtype: Any) -> jax.Array:
    """tokamax's Mosaic GPU ragged_dot_general, built for the current target's device."""
    tokamax = _tokamax()
    device = compile_device()
    if device is None:  # check_supported ran first; the context may have changed since
        raise NotSupported(f"no {current_target().name} device to build the Mosaic GPU kernel for")
    with jax.default_device(device), jax.named_scope(SCOPE):
        return tokamax.ragged_dot_general(lhs, rhs, sizes, dims, preferred_element_type=out_dtype,
                                          implementation="mosaic_gpu")


def gmm_mosaic_gpu(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool = False,
                   out_dtype: Any = None) -> jax.Array:
    """Grouped matmul on tokamax's Mosaic GPU kernel (forward only; _api.py adds the VJP).

    Args:
      lhs: [T, K] bfloat16 / float16, rows sorted by group.
      rhs: [G, K, N] (or [G, N, K] with transpose_rhs), lhs's dtype.
      group_sizes: [G] int rows per group.
      transpose_rhs: rhs is stored [G, N, K].
      out_dtype: see `check_supported` (default: the input dtype).

    Returns:
      [T, N] in out_dtype: rows of group g are lhs[rows_g] @ rhs[g] (float32 accumulation); rows past
      sum(group_sizes) are zeros.
    """
    num_rows, k_dim = lhs.shape
    num_groups = rhs.shape[0]
    n_dim = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs.dtype, rhs.dtype))
    check_supported(lhs.dtype, rhs.dtype, out_dtype, k_dim, n_dim)
    if num_rows == 0 or k_dim == 0 or num_groups == 0 or n_dim == 0:
        return jnp.zeros((num_rows, n_dim), out_dtype)
    sizes, total = clamp_group_sizes(group_sizes, num_rows)
    padded = _round_up(num_rows, GMM_ROW_MULTIPLE)
    dims = _TRANSPOSED if transpose_rhs else _FORWARD

    def call(lhs, rhs, sizes):
        return _ragged_dot(_pad_rows(lhs, padded), rhs, sizes, dims, out_dtype)

    out = run_manual(call, lhs, rhs, sizes)[:num_rows]
    # the kernel leaves the row tiles no group owns unwritten
    owned = jnp.arange(num_rows, dtype=jnp.int32)[:, None] < total
    return jnp.where(owned, out, jnp.zeros((), out_dtype))
