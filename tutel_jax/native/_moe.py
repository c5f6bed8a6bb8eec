"""The routed experts of one MoE layer in one native CPU call (`moe_cpu.cc`, an XLA FFI custom call).

Decoding a few tokens is bound by reading the used experts' weights. XLA:CPU copies each expert's weights
chosen at run time before multiplying them, and dequantizes a packed expert into float32 in memory; the native
kernel streams the used experts' bytes once, in memory order, on every core of XLA's intra-op thread pool, and
decodes packed formats (FP8 block, MXFP4, NVFP4, per channel) in registers. `tutel_jax.layer._pipeline` uses it as
`dropless_impl='native'`.

  moe_experts(x, ids, enc, dec, w1, w2, up=..., b1=..., b2=..., glu=...)   any GLU experts, float or packed
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import quant
from ..core import varying_like
from ._build import register
from ._weights import bias_arg, check_activations, check_max_workers, empty, weight_args
from ..validation import check_choice

__all__ = ["moe_experts", "GLUS", "ensure_registered"]

TARGET = "tutel_jax_moe_experts"
GLUS = ("swiglu", "gpt_oss")


def ensure_registered() -> None:
    """Build (first use on this machine) and register the kernel; raises NativeKernelError when it cannot."""
    register("moe_cpu", "TutelJaxMoeExperts", TARGET)


def _out_in(w: Any, num_experts: int) -> tuple[int, int]:
    """(N, K) of an expert weight [E, N, K] (float or packed)."""
    shape = quant.logical_shape(w)
    if len(shape) != 3 or shape[0] != num_experts:
        raise ValueError(f"moe_experts: expected expert weights [E={num_experts}, out, in], got {shape}")
    return shape[1], shape[2]


def moe_experts(x: jax.Array, expert_ids: jax.Array, enc: jax.Array, dec: jax.Array, w1: Any, w2: Any, *,
                up: Any = None, b1: jax.Array | None = None, b2: jax.Array | None = None, glu: str = "swiglu",
                alpha: float = 1.702, limit: float = 7.0, activations: str = "float32",
                max_workers: int | None = None) -> jax.Array:
    """y [S, Mo] float32 = sum_k dec[k, s] * expert_{expert_ids[k, s]}(enc[k, s] * x[s]), on CPU.

    expert_e(r) = W2_e . glu(W1_e . r + b1_e) + b2_e, computed in float32 (packed weights decoded exactly as
    `pallas_kernels.quant`'s reference dequantizers do).
      x [S, M]; expert_ids [K, S] (ids outside [0, E) are skipped: another device's experts); enc, dec [K, S]
      (an assignment with a zero weight is skipped: dropped).
      w1: the first matmul's weight of 2I outputs [E, 2I, M]; with `up`, w1 is the gate weight and `up` the up
        weight, [E, I, M] each (SwiGLU experts). Every weight is [E, out, in], float32 / bfloat16 or packed.
      w2: [E, Mo, I].  b1 [E, 2I], b2 [E, Mo]: optional biases (float32 and bfloat16
        ones are read as they are, only the used experts' rows).
      glu: 'swiglu' (h = [gate | up] halves: silu(gate) * up) or 'gpt_oss' (h interleaved, gate = even and up =
        odd columns: `experts_glu.gpt_oss_glu` with alpha and limit).
      activations: 'float32', or 'int8': the activations of an MXFP4 / NVFP4 weight's matmuls, whatever the
        rows per expert (a prefill's too, a register pass of rows at a time), quantized to int8 per block of 32 (scale max|x| /
        127, llama.cpp's Q8_0) and multiplied in integer dot products (AVX-512 VNNI / AVX-VNNI where present):
        about 1e-2 of the output's rms on gpt-oss-20b's layer against float64 (README, "int8 activations";
        tests/native/test_native_q8.py).
      max_workers: threads to use at most (default: XLA's intra-op pool).
    Not differentiable by itself (`tutel_jax.layer._pipeline` gives it the 'loop' path's VJP).
    """
    check_choice(glu, "moe_experts: glu", GLUS)
    workers = check_max_workers(max_workers, "moe_experts")
    int8 = check_activations(activations, "moe_experts")
    num_tokens, model_dim = x.shape
    if expert_ids.shape != enc.shape or enc.shape != dec.shape or expert_ids.ndim != 2 \
            or expert_ids.shape[1] != num_tokens:
        raise ValueError(f"moe_experts: expert_ids, enc and dec must be [K, S={num_tokens}], got "
                         f"{tuple(expert_ids.shape)}, {tuple(enc.shape)}, {tuple(dec.shape)}")
    num_experts = quant.logical_shape(w2)[0]
    parts = [w1] if up is None else [w1, up]
    n1 = [_out_in(w, num_experts) for w in parts]
    mo, hidden = _out_in(w2, num_experts)
    if any(k != model_dim for _, k in n1) or sum(n for n, _ in n1) != 2 * hidden:
        raise ValueError(f"moe_experts: W1 must map M={model_dim} to 2I={2 * hidden} outputs (W2 is [I={hidden} -> "
                         f"{mo}]), got {[quant.logical_shape(w) for w in parts]}")
    args1 = [weight_args(w) for w in parts]
    args2 = weight_args(w2)
    if len({a[0] for a in args1}) != 1:
        raise ValueError("moe_experts: gate and up weights must have the same format")
    if len(args1) == 1:
        args1.append((args1[0][0], empty(), empty(), empty()))
    biases = []
    for name, b, size in (("b1", b1, 2 * hidden), ("b2", b2, mo)):
        if b is not None and tuple(b.shape) != (num_experts, size):
            raise ValueError(f"moe_experts: {name} must be [E={num_experts}, {size}], got {tuple(b.shape)}")
        biases.append(empty() if b is None else bias_arg(b))
    ensure_registered()
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((num_tokens, mo), jnp.float32), vmap_method="sequential")
    y = call(x.astype(jnp.float32), expert_ids.astype(jnp.int32), enc.astype(jnp.float32), dec.astype(jnp.float32),
             *args1[0][1:], *args1[1][1:], *args2[1:], *biases,
             w1_format=np.int64(args1[0][0]), w2_format=np.int64(args2[0]), split_up=up is not None,
             glu=np.int64(GLUS.index(glu)), alpha=np.float32(alpha), limit=np.float32(limit),
             int8_activations=int8, max_workers=np.int64(workers))
    # inside shard_map the result varies wherever an input does (the custom call's type does not say so)
    return varying_like(y, x, expert_ids, enc, dec, *jax.tree_util.tree_leaves((w1, up, w2, b1, b2)))

