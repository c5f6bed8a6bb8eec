"""Quantized grouped matmul on Pallas Triton kernels (NVIDIA, AMD): activations x FP8-block / MXFP4 / NVFP4
weights, dequantized inside the kernel; semantics are reference.py's.

    quant_gmm_triton(x[T, K], w[G, N, K] quantized, group_sizes[G], ...) -> [T, N]

Kernel: the grouped-matmul kernel of gmm/pallas_triton.py (same tile schedule, grid and split-K) with a weight-tile loader
per format that turns the quantized bytes of one [block_n, block_k] tile into compute-dtype values in registers:
  - FP8 block: e4m3 -> compute dtype (exact in bf16); the 128x128 scale is constant over a K step (block_k
    divides 128), so it multiplies the step's float32 partial product per output column (DeepSeek's trick:
    no per-element scale multiply, and no rounding of w * scale to bf16).
  - MXFP4: bytes -> two E2M1 nibbles by integer ops (low nibble = even element) times 2**(s - 127) built from
    the exponent bits; exact in bf16. The two halves are interleaved in registers (Triton join + reshape).
  - NVFP4: nibbles times float32(e4m3 block scale) (exact in bf16: at most 6 significant bits); the per-tensor
    global scale divides the float32 accumulator once at the end.
With bf16 activations the products are therefore exact and only the float32 accumulation order differs from
the reference.

Tiling (`QUANT_TILINGS`, per target; checked by the offline compile for shared memory and register spills):
decode (at most 64 rows per expert, memory bound): block_m = next_pow2(rows) (>= 16, the MMA minimum),
block_n = 64, block_k = 64 (a [64, 128] tile spills on every target), and split-K so that N tiles x splits >= 2
programs per SM (`Target.num_sms`): each program streams a [64, 64] byte tile per step (4 KiB FP8, 2 KiB FP4)
with 4 pipeline stages in flight (2 on MI300). The float32 partials [splits, M, N] are tiny at decode sizes and
summed by XLA (deterministic, no atomics). Prefill (larger groups) uses 128-row tiles. FP8 on a target without
e4m3 conversion (A100) is read as uint8 bit patterns and decoded with integer operations (`formats.e4m3_to_f32`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plt

from .._select import NotSupported
from .._util import cdiv, col, next_pow2, row
from ..gmm import GmmConfig, grouped_matmul_call
from ..targets import current_target, get_target
from .formats import (FP8_BLOCK, MXFP4_BLOCK, NVFP4_BLOCK, Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight,
                      e2m1_to_f32, e4m3_to_f32, e8m0_to_f32)

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


def _fp8_zero() -> jax.Array:
    """An e4m3 zero for masked loads (Triton cannot cast the integer literal 0 to fp8)."""
    return jnp.zeros((), jnp.float8_e4m3fn)


def _expand(scale: jax.Array, bn: int, groups: int, per: int) -> jax.Array:
    """[bn, groups] -> [bn, groups * per]: each group scale repeated over its `per` packed bytes."""
    return jnp.broadcast_to(scale[:, :, None], (bn, groups, per)).reshape(bn, groups * per)


def _fp4_tile(packed: jax.Array, scale: jax.Array) -> jax.Array:
    """uint8 [bn, bk/2] and a float32 scale per byte [bn, bk/2] -> float32 [bn, bk], the low nibble first."""
    lo = e2m1_to_f32(packed & 0xF) * scale
    hi = e2m1_to_f32(packed >> 4) * scale
    bn, half = packed.shape
    return jnp.stack([lo, hi], axis=-1).reshape(bn, 2 * half)


def _e4m3_load(ref, index, mask, fp8_bits: bool) -> jax.Array:
    """A masked load of e4m3 values as float32: a hardware conversion, or (fp8_bits) the ref holds the e4m3 bit
    patterns as uint8 and integer operations decode them (`e4m3_to_f32`: targets without e4m3 instructions)."""
    if fp8_bits:
        return e4m3_to_f32(plt.load(ref.at[index], mask=mask, other=0))
    return plt.load(ref.at[index], mask=mask, other=_fp8_zero()).astype(jnp.float32)


def _fp8_operand(a: jax.Array, fp8_bits: bool) -> jax.Array:
    """e4m3 kernel operands travel as their uint8 bit patterns when the kernel decodes them with integer ops."""
    return lax.bitcast_convert_type(a, jnp.uint8) if fp8_bits else a


class _Fp8BlockRhs:
    """weight e4m3 [G, N, K] (uint8 bit patterns when fp8_bits), scale_inv float32 [G, ceil(N/128), ceil(K/128)]."""

    num_refs = 2
    transposed = True

    def __init__(self, fp8_bits: bool = False):
        self.fp8_bits = fp8_bits

    def check_block_k(self, block_k: int) -> None:
        if FP8_BLOCK % block_k:
            raise NotSupported(f"FP8 block kernel needs block_k dividing 128, got {block_k}")

    def tile(self, refs, g, k0, ks, ns, kmask, nmask, compute_dtype):
        w_ref, _ = refs
        w = _e4m3_load(w_ref, (g, row(ns), col(ks)), row(nmask) & col(kmask), self.fp8_bits)
        return w.astype(compute_dtype)  # e4m3 -> bf16 is exact

    def step_scale(self, refs, g, k0, ns, nmask):
        _, s_ref = refs
        return plt.load(s_ref.at[g, ns // FP8_BLOCK, k0 // FP8_BLOCK], mask=nmask, other=0)

    def final_scale(self, refs, g):
        return None


class _Mxfp4Rhs:
    """blocks viewed as uint8 [G, N, K/2], scales uint8 [G, N, K/32]."""

    num_refs = 2
    transposed = True

    def __init__(self, k_dim: int):
        self.k_dim = k_dim

    def check_block_k(self, block_k: int) -> None:
        if block_k % MXFP4_BLOCK:
            raise NotSupported(f"MXFP4 kernel needs block_k a multiple of 32, got {block_k}")

    def tile(self, refs, g, k0, ks, ns, kmask, nmask, compute_dtype):
        b_ref, s_ref = refs
        bn, bk = ns.shape[0], ks.shape[0]
        kb = k0 // 2 + jnp.arange(bk // 2, dtype=jnp.int32)
        packed = plt.load(b_ref.at[g, row(ns), col(kb)], mask=row(nmask) & col(kb < self.k_dim // 2), other=0)
        sg = k0 // MXFP4_BLOCK + jnp.arange(bk // MXFP4_BLOCK, dtype=jnp.int32)
        s = plt.load(s_ref.at[g, row(ns), col(sg)], mask=row(nmask) & col(sg < self.k_dim // MXFP4_BLOCK),
                     other=127)
        scale = _expand(e8m0_to_f32(s), bn, bk // MXFP4_BLOCK, MXFP4_BLOCK // 2)
        return _fp4_tile(packed, scale).astype(compute_dtype)  # exact in bf16

    def step_scale(self, refs, g, k0, ns, nmask):
        return None

    def final_scale(self, refs, g):
        return None


class _Nvfp4Rhs:
    """packed uint8 [G, N, K/2], scale e4m3 [G, N, K/16] (uint8 bit patterns when fp8_bits), global_scale
    float32 [G]."""

    num_refs = 3
    transposed = True

    def __init__(self, k_dim: int, global_multiplies: bool = False, fp8_bits: bool = False):
        self.k_dim = k_dim
        self.final_divides = not global_multiplies  # compressed-tensors divides, ModelOpt multiplies
        self.fp8_bits = fp8_bits

    def check_block_k(self, block_k: int) -> None:
        if block_k % NVFP4_BLOCK:
            raise NotSupported(f"NVFP4 kernel needs block_k a multiple of 16, got {block_k}")

    def tile(self, refs, g, k0, ks, ns, kmask, nmask, compute_dtype):
        p_ref, s_ref, _ = refs
        bn, bk = ns.shape[0], ks.shape[0]
        kb = k0 // 2 + jnp.arange(bk // 2, dtype=jnp.int32)
        packed = plt.load(p_ref.at[g, row(ns), col(kb)], mask=row(nmask) & col(kb < self.k_dim // 2), other=0)
        sg = k0 // NVFP4_BLOCK + jnp.arange(bk // NVFP4_BLOCK, dtype=jnp.int32)
        s = _e4m3_load(s_ref, (g, row(ns), col(sg)), row(nmask) & col(sg < self.k_dim // NVFP4_BLOCK),
                       self.fp8_bits)
        scale = _expand(s, bn, bk // NVFP4_BLOCK, NVFP4_BLOCK // 2)
        # nibble x e4m3 has at most 6 significant bits: exact in bf16; the global scale divides at the end
        return _fp4_tile(packed, scale).astype(compute_dtype)

    def step_scale(self, refs, g, k0, ns, nmask):
        return None

    def final_scale(self, refs, g):
        _, _, gs_ref = refs
        return gs_ref[g]


def _operands(w: Any, num_groups: int):
    """(loader, kernel operands, N, K) for a quantized weight with leading dim G, for the target being traced
    for (without e4m3 hardware, FP8 values are passed as bits and decoded with integer operations)."""
    fp8_bits = not current_target().fp8_convert
    if isinstance(w, Fp8BlockWeight):
        _, n_dim, k_dim = w.weight.shape
        if w.weight.dtype != jnp.float8_e4m3fn:
            raise ValueError(f"FP8 block weight must be float8_e4m3fn, got {w.weight.dtype}")
        return (_Fp8BlockRhs(fp8_bits), (_fp8_operand(w.weight, fp8_bits), w.scale_inv.astype(jnp.float32)),
                n_dim, k_dim)
    if isinstance(w, Mxfp4Weight):
        g, n_dim, groups, _ = w.blocks.shape
        k_dim = groups * MXFP4_BLOCK
        return _Mxfp4Rhs(k_dim), (w.blocks.reshape(g, n_dim, k_dim // 2), w.scales), n_dim, k_dim
    if isinstance(w, Nvfp4Weight):
        _, n_dim, half = w.packed.shape
        global_scale = jnp.broadcast_to(w.global_scale.astype(jnp.float32).reshape(-1), (num_groups,))
        return (_Nvfp4Rhs(2 * half, w.global_multiplies, fp8_bits),
                (w.packed, _fp8_operand(w.scale, fp8_bits), global_scale), n_dim, 2 * half)
    raise TypeError(f"expected Fp8BlockWeight, Mxfp4Weight or Nvfp4Weight, got {type(w).__name__}")


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
