"""The routed SwiGLU experts of one MoE layer in one native CPU call (`moe_cpu.cc`, an XLA FFI custom call).

Decoding a few tokens is bound by reading the used experts' weights. XLA:CPU copies each expert's weights
chosen at run time before multiplying them; the native kernel streams them once, in memory order, on every core
of XLA's intra-op thread pool. `tutel_jax.layer` uses it as `dropless_impl='native'`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..vma import varying_like
from .build import register

__all__ = ["moe_swiglu", "WEIGHT_DTYPES", "ensure_registered"]

TARGET = "tutel_jax_moe_swiglu"
WEIGHT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_MAX_WORKERS = 1 << 30


def ensure_registered() -> None:
    """Build (first use on this machine) and register the kernel; raises NativeKernelError when it cannot."""
    register("moe_cpu", "TutelJaxMoeSwiglu", TARGET)


def moe_swiglu(x: jax.Array, expert_ids: jax.Array, enc: jax.Array, dec: jax.Array, gate_up: jax.Array,
               down: jax.Array, *, max_workers: int | None = None) -> jax.Array:
    """y [S, Mo] float32 = sum_k dec[k, s] * expert_{expert_ids[k, s]}(enc[k, s] * x[s]), on CPU.

    expert_e(r) = (silu(r @ gate_e) * (r @ up_e)) @ down_e, computed in float32.
      x [S, M]; expert_ids [K, S] (ids outside [0, E) are skipped: another device's experts); enc, dec [K, S]
      (an assignment with a zero weight is skipped: dropped); gate_up [E, M, 2, I] or [E, M, 2I] (gate columns
      first); down [E, I, Mo]; weights float32 or bfloat16 (both the same).
      max_workers: threads to use at most (default: XLA's intra-op pool).
    Not differentiable by itself (`tutel_jax.layer` gives it the 'loop' path's VJP).
    """
    if gate_up.ndim == 4:
        gate_up = gate_up.reshape(gate_up.shape[0], gate_up.shape[1], -1)
    num_tokens, model_dim = x.shape
    if (gate_up.ndim != 3 or down.ndim != 3 or gate_up.shape[1] != model_dim or gate_up.shape[0] != down.shape[0]
            or gate_up.shape[2] != 2 * down.shape[1]):
        raise ValueError(f"moe_swiglu: expected gate_up [E, M={model_dim}, 2I] and down [E, I, Mo], got "
                         f"{tuple(gate_up.shape)} and {tuple(down.shape)}")
    if expert_ids.shape != enc.shape or enc.shape != dec.shape or expert_ids.ndim != 2 \
            or expert_ids.shape[1] != num_tokens:
        raise ValueError(f"moe_swiglu: expert_ids, enc and dec must be [K, S={num_tokens}], got "
                         f"{tuple(expert_ids.shape)}, {tuple(enc.shape)}, {tuple(dec.shape)}")
    if gate_up.dtype != down.dtype or jnp.dtype(gate_up.dtype) not in WEIGHT_DTYPES:
        raise ValueError(f"moe_swiglu: expert weights must both be float32 or bfloat16, got {gate_up.dtype} and "
                         f"{down.dtype}")
    if max_workers is not None and (isinstance(max_workers, bool) or not isinstance(max_workers, int)
                                    or max_workers < 1):
        raise ValueError(f"moe_swiglu: max_workers must be a positive int or None, got {max_workers!r}")
    ensure_registered()
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((num_tokens, down.shape[2]), jnp.float32),
                            vmap_method="sequential")
    y = call(x.astype(jnp.float32), expert_ids.astype(jnp.int32), enc.astype(jnp.float32), dec.astype(jnp.float32),
             gate_up, down, max_workers=np.int64(max_workers or _MAX_WORKERS))
    # inside shard_map the result varies wherever an input does (the custom call's type does not say so)
    return varying_like(y, x, expert_ids, enc, dec, gate_up, down)
