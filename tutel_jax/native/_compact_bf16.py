"""Compact bfloat16: a bfloat16 weight [N, K] ([out, in]) held losslessly in 12 bits per element.

    compact_bf16(w) -> CompactBf16 | None        (encode at load; None where it does not apply or pay)
    CompactBf16.dequantize() -> bfloat16 [N, K]  (the exact weight, in JAX: the reference)
    CompactBf16.bfloat16() -> bfloat16 [N, K]    (the same, decoded by the native kernel on CPU: XLA's matmuls
                                                  for many rows, e.g. a prefill, take it)

A decode step reads every weight of the attention projections and the lm_head once per token, so its speed is the
memory's; a bfloat16 element spends 8 bits on its exponent, while the weights of a layer use about a dozen exponent
values (entropy ~2.5 bits for trained or random-normal weights). Each element keeps the low byte of its bfloat16
code (the exponent's last bit and the 7 mantissa bits) and a 4-bit code for the high byte: its sign and one of 8
values of the exponent's other bits (slot 0: 0, which holds zeros and subnormals; then the 7 most frequent others),
so 16 exponents are coded. The rare other elements (exponents outside the table, inf / NaN; ~0.03% of a normal
weight) are patches, a list of (row, column, value) the kernels add after each row's dot products. The native dense
kernel (`dense_cpu.cc`, layout in `packed_rows.h`) decodes the codes in registers with byte table lookups and
unpacks (x86: a few instructions per 32 elements, faster than memory delivers them): 3/4 of the bytes of the
bfloat16 weight per token, the same values, float32 sums.

Layout (`CompactBf16`):
  groups  uint8 [N, K/32, 48]: per 32 elements, 32 low bytes, then 16 bytes of codes (byte j: element j in the low
          nibble, element j + 16 in the high one); code = sign << 3 | slot
  index   int32 [16 + N + 1]: each code's high byte << 24 (the float32 bits it contributes), then each row's first
          patch (CSR offsets into patches)
  patches int32 [P, 3]: (row, column, float32 bits of the value), by row; the groups hold zero there; rows past
          the index's last offset are padding (row N: `with_patch_capacity`)
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core import empty_aligned
from .. import core
from ._build import can_register, load, register

__all__ = ["CompactBf16", "compact_bf16", "NATIVE_ID", "GROUP", "GROUP_BYTES", "SLOTS"]

NATIVE_ID = 6  # packed_rows.h
GROUP, GROUP_BYTES = 32, 48  # elements per group, bytes per group
SLOTS = 8  # high-byte values (but the sign) with a code; slot 0 is 0
_DECODE = ("dense_cpu", "TutelJaxCompactDecode", "tutel_jax_compact_decode")  # source, symbol, FFI target
#: compact only when it saves at least this share of the bfloat16 bytes (few patches)
MIN_SAVING = 0.2


@dataclasses.dataclass(frozen=True)
class CompactBf16:
    """A bfloat16 weight [N, K] in 12 bits per element (module docstring): groups uint8 [N, K/32, 48], index
    int32 [16 + N + 1], patches int32 [P, 3]."""

    groups: jax.Array
    index: jax.Array
    patches: jax.Array
    format = "compact_bf16"
    dtype = jnp.dtype(jnp.bfloat16)  # of the values it holds

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, n, g, _ = self.groups.shape
        return (*lead, n, g * GROUP)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def nbytes(self) -> int:
        return int(self.groups.size + 4 * (self.index.size + self.patches.size))

    def dequantize(self) -> jax.Array:
        """The weight, bfloat16 [N, K], exactly."""
        n, k = self.shape
        low = self.groups[..., :GROUP].astype(jnp.uint16)
        c = self.groups[..., GROUP:]
        codes = jnp.concatenate([c & 15, c >> 4], axis=-1)  # [N, K/32, 32]
        high = (self.index[:16].astype(jnp.uint32) >> 24).astype(jnp.uint16)
        bits = low | (high[codes] << 8)
        bits = bits.reshape(n, k)
        if self.patches.shape[0]:
            p = self.patches
            bits = bits.at[p[:, 0], p[:, 1]].set((p[:, 2].astype(jnp.uint32) >> 16).astype(jnp.uint16),
                                                 mode="drop")  # padding: row N
        return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)

    def bfloat16(self) -> jax.Array:
        """The weight, bfloat16 [N, K], exactly: decoded by the native kernel (`dense_cpu.cc`, over XLA's
        intra-op pool, at the memory's speed) on CPU where it builds, else `dequantize()`."""
        if not (core.platform() == "cpu" and can_register(*_DECODE)):
            return self.dequantize()
        register(*_DECODE)
        _, data, index, patches = self.native_args()
        call = jax.ffi.ffi_call(_DECODE[2], jax.ShapeDtypeStruct(self.shape, jnp.bfloat16))
        return call(data, index, patches)

    def with_patch_capacity(self, count: int) -> "CompactBf16":
        """The same weight with its patch list padded to `count` entries (row N: read by nothing), so that the
        weights of several layers have one shape (one compiled program for them all)."""
        pad = count - self.patches.shape[0]
        if pad < 0:
            raise ValueError(f"with_patch_capacity: {self.patches.shape[0]} patches do not fit in {count}")
        if pad == 0:
            return self
        filler = np.zeros((pad, 3), np.int32)
        filler[:, 0] = self.shape[0]
        patches = np.concatenate([np.asarray(self.patches), filler])
        return dataclasses.replace(self, patches=jax.device_put(patches))

    def native_args(self) -> tuple[int, jax.Array, jax.Array, jax.Array]:
        """(format, data [E, N, K/32 * 48], index [E, 17 + N], patches [E, P, 3]) for `weights.h`; leading axes
        (the native dense kernel adds one) are E."""
        *lead, n, g, _ = self.groups.shape
        e = int(np.prod(lead, dtype=np.int64))
        return (NATIVE_ID, self.groups.reshape(e, n, g * GROUP_BYTES), self.index.reshape(e, -1),
                self.patches.reshape(e, -1, 3))


jax.tree_util.register_dataclass(CompactBf16, data_fields=["groups", "index", "patches"], meta_fields=[])


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


def compact_bf16(w: Any) -> CompactBf16 | None:
    """The compact form of a bfloat16 weight [N, K] (K a multiple of 32), or None: not such a weight, or fewer
    than MIN_SAVING of its bytes saved (exponents spread too wide). Encoded by the native library (one pass to
    count the exponents, one to write the groups and patches); needs a C++ compiler (`native.build`)."""
    a = np.asarray(w) if isinstance(w, (np.ndarray, jax.Array)) else None
    if a is None or a.ndim != 2 or a.dtype != jnp.bfloat16 or a.shape[1] % GROUP or a.size == 0:
        return None
    n, k = a.shape
    u = np.ascontiguousarray(a).view(np.uint16)
    lib = load("dense_cpu")
    counts = np.zeros(128, np.int64)  # per high byte but the sign
    lib.TutelJaxBf16HighCounts(_ptr(u), ctypes.c_int64(u.size), _ptr(counts))
    others = [h for h in np.argsort(-counts[1:], kind="stable")[:SLOTS - 1] + 1 if counts[h] > 0]
    slots = [0, *others]
    patches = int(u.size - counts[slots].sum())
    size = n * (k // GROUP) * GROUP_BYTES + 4 * (17 + n + 3 * patches)
    if size > (1 - MIN_SAVING) * 2 * u.size or patches >= 2 ** 31:
        return None
    slot_of = np.full(128, 255, np.uint8)
    slot_of[slots] = np.arange(len(slots))
    index = np.zeros(17 + n, np.int32)
    high = np.zeros(16, np.uint32)
    high[:len(slots)] = slots
    high[8:8 + len(slots)] = np.asarray(slots, np.uint32) | 0x80  # negative
    index[:16] = (high << 24).view(np.int32)
    groups = empty_aligned((n, k // GROUP, GROUP_BYTES), np.uint8)
    patch_list = np.zeros((patches, 3), np.int32)
    lib.TutelJaxCompactBf16Encode.restype = ctypes.c_int64
    got = lib.TutelJaxCompactBf16Encode(_ptr(u), ctypes.c_int64(n), ctypes.c_int64(k), _ptr(slot_of),
                                        _ptr(groups), _ptr(index[16:]), _ptr(patch_list), ctypes.c_int64(patches))
    if got != patches:  # the counts and the encoder disagree: a bug, never a silent wrong weight
        raise RuntimeError(f"compact_bf16: {got} patches written, {patches} counted")
    return CompactBf16(jax.device_put(groups), jax.device_put(index), jax.device_put(patch_list))
