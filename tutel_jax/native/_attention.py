"""One decode step of attention over a static KV cache in one native CPU call (`attention_cpu.cc`, an XLA FFI
custom call): the new key and value written into the caches in place, then each query head's softmax over the
slots it sees.

    o, k_cache, v_cache = decode_attention(q, k, v, k_cache, v_cache, index, key_valid, scale)

Same semantics as `tutel_jax.models._layers.write_cache` followed by `attend` for one query token. XLA:CPU
computes a bfloat16 cache update and the value product in float32: it converts and copies whole caches at every
step, which at a few hundred slots costs more than the step's attention arithmetic. The kernel reads each cache
once where it lies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import core
from ..core import varying_like
from ._build import can_register, register
from ._weights import FLOAT_DTYPES, check_max_workers
from ..validation import check_choice

__all__ = ["decode_attention", "attends_natively", "check_attention_impl", "ATTENTION_IMPLS", "CACHE_DTYPES"]

TARGET = "tutel_jax_decode_attention"
_LIBRARY = ("attention_cpu", "TutelJaxDecodeAttention", TARGET)  # the source, its handler, the FFI target
CACHE_DTYPES = FLOAT_DTYPES  # float32, bfloat16
#: how a model's decode steps attend (`attends_natively`): 'auto', 'xla' or 'native'
ATTENTION_IMPLS = ("auto", "xla", "native")


def ensure_registered() -> None:
    """Build (first use on this machine) and register the kernel; raises NativeKernelError when it cannot."""
    register(*_LIBRARY)


def check_attention_impl(impl: str) -> str:
    """`impl` if it is one of ATTENTION_IMPLS, else ValueError."""
    return check_choice(impl, "attention_impl", ATTENTION_IMPLS)


def attends_natively(q: jax.Array, cache: jax.Array, impl: str = "auto") -> bool:
    """Whether `impl` runs this attention as the kernel: a step of one query token over a float32 or bfloat16
    cache ('xla': never; 'auto': on CPU when the kernel can be built; 'native': always, building the kernel or
    raising NativeKernelError). Several query tokens (a prefill) are XLA's attention whatever `impl` says."""
    if check_attention_impl(impl) == "xla" or q.shape[1] != 1 or jnp.dtype(cache.dtype) not in CACHE_DTYPES:
        return False
    if impl == "native":
        ensure_registered()
        return True
    return core.platform() == "cpu" and can_register(*_LIBRARY)


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                     index: jax.Array, key_valid: jax.Array, scale: float, *, window: int | None = None,
                     sinks: jax.Array | None = None, max_workers: int | None = None):
    """(o float32 [B, 1, Hq, Dv], new k_cache, new v_cache) for one query token per row.

    q [B, 1, Hq, D]; k [B, 1, Hkv, D] and v [B, 1, Hkv, Dv]: the token's key and value, written (in the caches'
    dtype) at slot index (clamped into [0, L)); k_cache [B, Hkv, L, D], v_cache [B, Hkv, L, Dv] float32 or
    bfloat16 (donate them for an in-place update); index [] or [B] int: each row's query slot; key_valid [B, L]
    bool; window: the layer's sliding window (None: all slots); sinks [Hq]: per-head logits joining the softmax.
    Visibility and the softmax are those of `models.layers.attend`."""
    workers = check_max_workers(max_workers, "decode_attention")
    B, T, Hq, D = q.shape
    _, Hkv, L, _ = k_cache.shape
    Dv = v_cache.shape[-1]
    if T != 1 or k.shape != (B, 1, Hkv, D) or v.shape != (B, 1, Hkv, Dv) or v_cache.shape[:3] != (B, Hkv, L):
        raise ValueError(f"decode_attention: inconsistent shapes q {q.shape}, k {k.shape}, v {v.shape}, "
                         f"caches {k_cache.shape} / {v_cache.shape}")
    if Hq % Hkv or k_cache.dtype != v_cache.dtype or jnp.dtype(k_cache.dtype) not in CACHE_DTYPES:
        raise ValueError(f"decode_attention: Hq={Hq} must be a multiple of Hkv={Hkv} and both caches float32 or "
                         f"bfloat16, got {k_cache.dtype} / {v_cache.dtype}")
    ensure_registered()
    dtype = k_cache.dtype
    index = jnp.broadcast_to(jnp.asarray(index, jnp.int32), (B,))
    sinks = jnp.zeros((0,), jnp.float32) if sinks is None else sinks.astype(jnp.float32).reshape(Hq)
    call = jax.ffi.ffi_call(
        TARGET, (jax.ShapeDtypeStruct((B, Hq, Dv), jnp.float32), jax.ShapeDtypeStruct(k_cache.shape, dtype),
                 jax.ShapeDtypeStruct(v_cache.shape, dtype)),
        input_output_aliases={3: 1, 4: 2}, vmap_method="sequential")
    o, k_cache, v_cache = call(q.reshape(B, Hq, D).astype(jnp.float32), k.reshape(B, Hkv, D).astype(dtype),
                               v.reshape(B, Hkv, Dv).astype(dtype), k_cache, v_cache, index,
                               key_valid.astype(jnp.bool_), sinks, scale=np.float32(scale),
                               window=np.int64(window or 0), max_workers=np.int64(workers))
    o, k_cache, v_cache = (varying_like(a, q, k, v, k_cache, v_cache) for a in (o, k_cache, v_cache))
    return o.reshape(B, 1, Hq, Dv), k_cache, v_cache
