"""Quantized grouped matmul on Pallas Triton kernels (NVIDIA, AMD): activations x FP8-block / MXFP4 / NVFP4 /
int8 weights, dequantized inside the kernel; semantics are _reference.py's.

    quant_gmm_triton(x[T, K], w[G, N, K] quantized, group_sizes[G], ...) -> [T, N]

Kernel: the grouped-matmul kernel of gmm/_pallas_triton.py (same tile schedule, grid and split-K) with the weight
format's tile loader (`formats/<format>.py`), which turns the quantized bytes of one [block_n, block_k] tile into
compute-dtype values in registers (FP8 block: e4m3 values, the block scale per K step; MXFP4 / NVFP4: nibbles
decoded by integer ops times their block scale; NVFP4's global scale applies to the accumulator at the end).
With bf16 activations the products are therefore exact and only the float32 accumulation order differs from
the reference.

Tiling (`QUANT_TILINGS`, per target; checked by the offline compile for shared memory and register spills):
decode (at most 64 rows per expert, memory bound): block_m = next_pow2(rows) (>= 16, the MMA minimum),
block_n = 64, block_k = 64 (a [64, 128] tile spills on every target), and split-K so that N tiles x splits >= 2
programs per SM (`Target.num_sms`): each program streams a [64, 64] byte tile per step (4 KiB FP8, 2 KiB FP4)
with 4 pipeline stages in flight (2 on MI300). The float32 partials [splits, M, N] are tiny at decode sizes and
summed by XLA (deterministic, no atomics). Prefill (larger groups) uses 128-row tiles. FP8 on a target without
e4m3 conversion (A100) is read as uint8 bit patterns and decoded with integer operations (`e4m3_to_f32`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from .._util import cdiv, next_pow2
from ..gmm import GmmConfig, grouped_matmul_call
from ..targets import current_target, get_target
from .formats import FORMATS, Nvfp4Weight, format_of

__all__ = ["quant_gmm_triton", "check_triton", "default_quant_config", "QuantMatmulConfig", "QUANT_TILINGS",
           "DECODE_ROWS", "tiling_candidates", "with_group_dim"]

QuantMatmulConfig = GmmConfig  # same tiling fields (block_m, block_n, block_k, split_k, warps, stages)
#: at most this many rows per group take the decode tiling (narrow N tiles, split-K)
DECODE_ROWS = 64

#: Per target: the decode tiling (block_m is the largest; fewer rows per group take a smaller power of two) and
#: the prefill tilings for 16-bit and float32 activations. The weight tile is raw quantized bytes in shared memory
#: (1 byte per FP8 element, half a byte per FP4 one), the activation tile is bm * bk * itemsize per stage.
QUANT_TILINGS: dict[str, dict[str, GmmConfig]] = {
    # A100: the dequantized [bn, bk] tile and the MMA operands share the register file (no wgmma), so narrower
    # tiles than on H100 keep every format free of spills
    "sm_80": {"decode": GmmConfig(64, 64, 64, 1, 4, 4), "prefill_bf16": GmmConfig(128, 64, 64, 1, 8, 3),
              "prefill_f32": GmmConfig(128, 64, 32, 1, 8, 3)},
    "sm_90": {"decode": GmmConfig(64, 64, 64, 1, 4, 4), "prefill_bf16": GmmConfig(128, 128, 64, 1, 8, 3),
              "prefill_f32": GmmConfig(128, 128, 64, 1, 8, 3)},
    # B200: H100's tiles (the same shared memory per block; not yet tuned on a device)
    "sm_100": {"decode": GmmConfig(64, 64, 64, 1, 4, 4), "prefill_bf16": GmmConfig(128, 128, 64, 1, 8, 3),
               "prefill_f32": GmmConfig(128, 128, 64, 1, 8, 3)},
    # MI300: 64 KiB of LDS per workgroup holds two stages
    "gfx942": {"decode": GmmConfig(64, 64, 64, 1, 4, 2), "prefill_bf16": GmmConfig(128, 128, 64, 1, 8, 2),
               "prefill_f32": GmmConfig(64, 128, 64, 1, 4, 2)},
}


def default_quant_config(num_rows: int, k_dim: int, n_dim: int, num_groups: int = 1, dtype: Any = jnp.bfloat16,
                         target: str | None = None) -> GmmConfig:
    """Decode (at most DECODE_ROWS rows per group): narrow N tiles and split-K; prefill: wide tiles. The tilings
    come from `QUANT_TILINGS` for the target being traced for."""
    target = get_target(target or current_target())
    table = QUANT_TILINGS[target.name]
    rows_per_group = max(num_rows // max(num_groups, 1), 1)
    if rows_per_group <= DECODE_ROWS:
        base = table["decode"]
        bm = max(16, min(base.block_m, next_pow2(rows_per_group)))
        programs = cdiv(n_dim, base.block_n) * (cdiv(num_rows, bm) + num_groups)
        steps = cdiv(k_dim, base.block_k)
        split = 1  # split-K until the grid holds about two programs per SM
        while split * 2 <= steps // 2 and programs * split < 2 * target.num_sms:
            split *= 2
        return dataclasses.replace(base, block_m=bm, split_k=split)
    return table["prefill_f32" if jnp.dtype(dtype).itemsize >= 4 else "prefill_bf16"]


def tiling_candidates(target: str) -> dict[str, GmmConfig]:
    """Every tiling `default_quant_config` can pick for `target` (split-K aside, which only divides the K loop),
    keyed by a label: "decode_bm16" ... for each decode row tile, "prefill_bf16", "prefill_f32"; decode tiles
    with float32 activations are labelled "..._f32" (the caller picks the activation dtype from the label)."""
    table = QUANT_TILINGS[target]
    candidates = {}
    base = table["decode"]
    bm = 16
    while bm <= base.block_m:
        for suffix in ("", "_f32"):
            candidates[f"decode_bm{bm}{suffix}"] = dataclasses.replace(base, block_m=bm)
        bm *= 2
    candidates["prefill_bf16"] = table["prefill_bf16"]
    candidates["prefill_f32"] = table["prefill_f32"]
    return candidates


# ----------------------------------------------------------------------------------------------- loaders


def _operands(w: Any, num_groups: int):
    """(loader, kernel operands, N, K) of the weight's format (formats/), for the target being traced for
    (without e4m3 hardware, FP8 values are passed as bits and decoded with integer operations)."""
    fmt = format_of(w)
    if fmt is None:
        raise TypeError(f"expected a quantized weight ({', '.join(f.container.__name__ for f in FORMATS.values())}), "
                        f"got {type(w).__name__}")
    return fmt.triton(w, num_groups, not current_target().fp8_convert)


def with_group_dim(w: Any) -> Any:
    """A single [N, K] quantized weight as a one-expert [1, N, K] weight (free reshapes)."""
    if isinstance(w, Nvfp4Weight):
        return Nvfp4Weight(w.packed[None], w.scale[None], w.global_scale.reshape(1, 1), w.global_multiplies)
    return jax.tree_util.tree_map(lambda a: a[None], w)


def check_triton(w: Any, cfg: GmmConfig) -> None:
    """NotSupported unless the Triton kernel takes `w` (with a leading group dim) at this tiling."""
    _operands(w, w.shape[0])[0].check_block_k(cfg.block_k)


def quant_gmm_triton(x: jax.Array, w: Any, group_sizes: jax.Array, out_dtype: Any, cfg: GmmConfig,
                     interpret: bool) -> jax.Array:
    """`quant_gmm` on the grouped-matmul kernel with the format's weight-tile loader (arguments checked)."""
    loader, operands, n_dim, _ = _operands(w, w.shape[0])
    return grouped_matmul_call(x, operands, loader, group_sizes.astype(jnp.int32), n_dim, out_dtype, cfg,
                               interpret, name=f"tutel_quant_gmm_{w.format}")
