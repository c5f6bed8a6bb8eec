"""Compact bfloat16: a bfloat16 weight [N, K] ([out, in]) held losslessly in 12 bits per element.

    compact_bf16(w) -> CompactBf16 | None        (encode at load; None where it does not apply or pay)
    CompactBf16.dequantize() -> bfloat16 [N, K]  (the exact weight, in JAX: the reference)
    CompactBf16.bfloat16() -> bfloat16 [N, K]    (the same, decoded by the native kernel on CPU: XLA's matmuls
                                                  for many rows, e.g. a prefill, take it)

A decode step reads every weight of the attention projections and the lm_head once per token, so its speed is
the memory's; a bfloat16 element spends 8 bits on its exponent, while the weights of a layer use about a dozen
exponent values (entropy ~2.5 bits for trained or random-normal weights). Each element keeps its sign and 7
mantissa bits in one byte and its exponent as a 4-bit code into a per-weight table of the 15 most frequent
exponents (code 0: zero); the rare other elements (exponents outside the table, subnormals, inf / NaN; ~0.02% of
a normal weight) are patches, a list of (row, column, value) the kernels add after each row's dot products. The
native dense kernel (`dense_cpu.cc`, layout in `packed_rows.h`) decodes the codes in registers: 3/4 of the bytes
of the bfloat16 weight per token, the same values, float32 sums (AVX-512 BF16 dot products where the build has
them, as for bfloat16 rows).

Layout (`CompactBf16`):
  groups  uint8 [N, K/32, 48]: per 32 elements, 32 bytes (mantissa << 1 | sign), then 16 bytes of codes (byte j:
          element j in the low nibble, element j + 16 in the high one)
  index   int32 [16 + N + 1]: the float32 exponent bits (e << 23) of codes 0..15 (code 0: 0), then each row's
          first patch (CSR offsets into patches)
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

__all__ = ["CompactBf16", "compact_bf16", "NATIVE_ID", "GROUP", "GROUP_BYTES"]

NATIVE_ID = 6  # packed_rows.h
GROUP, GROUP_BYTES = 32, 48  # elements per group, bytes per group
CODES = 15  # exponents with a code (code 0 is zero)
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
        b = self.groups[..., :GROUP].astype(jnp.uint16)
        c = self.groups[..., GROUP:]
        codes = jnp.concatenate([c & 15, c >> 4], axis=-1)  # [N, K/32, 32]
        exps = (self.index[:16].astype(jnp.uint32) >> 16).astype(jnp.uint16)
        bits = ((b & 1) << 15) | (b >> 1) | exps[codes]
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
    counts = np.zeros(257, np.int64)
    lib.TutelJaxBf16ExponentCounts(_ptr(u), ctypes.c_int64(u.size), _ptr(counts))
    normal = counts[1:255]  # exponent fields of normal numbers (0: zero / subnormal, 255: inf / NaN)
    coded = [e + 1 for e in np.argsort(-normal, kind="stable")[:CODES] if normal[e] > 0]
    patches = int(u.size - counts[256] - counts[coded].sum())
    size = n * (k // GROUP) * GROUP_BYTES + 4 * (17 + n + 3 * patches)
    if size > (1 - MIN_SAVING) * 2 * u.size or patches >= 2 ** 31:
        return None
    code_of = np.zeros(256, np.uint8)
    code_of[coded] = np.arange(1, len(coded) + 1)
    index = np.zeros(17 + n, np.int32)
    index[1:len(coded) + 1] = np.asarray(coded, np.int32) << 23
    groups = empty_aligned((n, k // GROUP, GROUP_BYTES), np.uint8)
    patch_list = np.zeros((patches, 3), np.int32)
    lib.TutelJaxCompactBf16Encode.restype = ctypes.c_int64
    got = lib.TutelJaxCompactBf16Encode(_ptr(u), ctypes.c_int64(n), ctypes.c_int64(k), _ptr(code_of),
                                        _ptr(groups), _ptr(index[16:]), _ptr(patch_list), ctypes.c_int64(patches))
    if got != patches:  # the counts and the encoder disagree: a bug, never a silent wrong weight
        raise RuntimeError(f"compact_bf16: {got} patches written, {patches} counted")
    return CompactBf16(jax.device_put(groups), jax.device_put(index), jax.device_put(patch_list))
