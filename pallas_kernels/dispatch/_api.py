"""The dispatch ops with their custom VJPs, one for every backend:

    encode(x[S, M], weights[k, S], slots[k, S], num_slots) -> [num_slots, M]
    decode(data[num_slots, M], weights[k, S], slots[k, S]) -> [S, M]
    permute / unpermute: the same pair on the dropless grouped layout [k*S, M] (rows from `grouped_rows`)

Semantics: _reference.py. `implementation` picks the backend (`_select.choose`): "xla" (the reference), "pallas" /
"interpret" (_pallas_triton.py), "tpu" / "tpu_interpret" (the Mosaic row-gather kernel of _pallas_mosaic_tpu.py;
`config` is the Triton tiling and does not apply; the row dots of the weight gradients run their reference
there).

Backward: encode and decode are each other's transpose (dx = decode(g), ddata = encode(g)) and the weight
gradients are the row dots, each on the forward's implementation, so backward is as cheap as forward and never
forms a one-hot.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from .._manual import sum_to_primal_vma
from .._select import TPU_IMPLEMENTATIONS, choose, resolved_name
from . import _pallas_mosaic_tpu as pallas_mosaic_tpu
from ._pallas_triton import DispatchConfig, decode_triton, default_dispatch_config, encode_triton, row_dots_triton
from ._reference import decode_reference, encode_reference, row_dots_reference

__all__ = ["encode", "decode", "permute", "unpermute"]


def _fwd_encode(impl, cfg, x, weights, slots, num_slots):
    if impl == "xla":
        return encode_reference(x, weights, slots, num_slots)
    if impl in TPU_IMPLEMENTATIONS:
        return pallas_mosaic_tpu.encode_tpu(x, weights, slots, num_slots, interpret=impl == "tpu_interpret")
    return encode_triton(x, weights, slots, num_slots, cfg, impl == "interpret")


def _fwd_decode(impl, cfg, data, weights, slots):
    if impl == "xla":
        return decode_reference(data, weights, slots)
    if impl in TPU_IMPLEMENTATIONS:
        return pallas_mosaic_tpu.decode_tpu(data, weights, slots, interpret=impl == "tpu_interpret")
    return decode_triton(data, weights, slots, cfg, impl == "interpret")


def _row_dots(impl, cfg, a, b, slots):
    if impl == "xla" or impl in TPU_IMPLEMENTATIONS:  # no TPU kernel: XLA's gather + reduce
        return row_dots_reference(a, b, slots)
    return row_dots_triton(a, b, slots.astype(jnp.int32), cfg, impl == "interpret")


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 5))
def _encode(impl, cfg, x, weights, slots, num_slots):
    return _fwd_encode(impl, cfg, x, weights, slots, num_slots)


def _encode_vjp_fwd(impl, cfg, x, weights, slots, num_slots):
    return _fwd_encode(impl, cfg, x, weights, slots, num_slots), (x, weights, slots)


def _encode_vjp_bwd(impl, cfg, num_slots, res, g):
    x, weights, slots = res
    dx = _fwd_decode(impl, cfg, g, weights, slots).astype(x.dtype)
    dw = _row_dots(impl, cfg, x, g, slots).astype(weights.dtype)
    return sum_to_primal_vma(dx, x), sum_to_primal_vma(dw, weights), None


_encode.defvjp(_encode_vjp_fwd, _encode_vjp_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _decode(impl, cfg, data, weights, slots):
    return _fwd_decode(impl, cfg, data, weights, slots)


def _decode_vjp_fwd(impl, cfg, data, weights, slots):
    return _fwd_decode(impl, cfg, data, weights, slots), (data, weights, slots)


def _decode_vjp_bwd(impl, cfg, res, g):
    data, weights, slots = res
    ddata = _fwd_encode(impl, cfg, g, weights, slots, data.shape[0]).astype(data.dtype)
    dw = _row_dots(impl, cfg, g, data, slots).astype(weights.dtype)
    return sum_to_primal_vma(ddata, data), sum_to_primal_vma(dw, weights), None


_decode.defvjp(_decode_vjp_fwd, _decode_vjp_bwd)


def _tpu_check(implementation, num_slots: int, weights: jax.Array, dtype):
    """The TPU kernels' check for `choose`; it covers the backward too (encode <-> decode, same tables)."""
    interpret = resolved_name(implementation) == "tpu_interpret"
    entries = max(int(num_slots), int(weights.size))
    return lambda: pallas_mosaic_tpu.check_supported(entries, dtype, interpret=interpret)


def _check(x: jax.Array, weights: jax.Array, slots: jax.Array, what: str) -> None:
    if x.ndim != 2:
        raise ValueError(f"{what} must be 2-D [rows, M], got shape {x.shape}")
    if weights.ndim != 2 or slots.shape != weights.shape:
        raise ValueError(f"weights and slots must both be [k, S], got {weights.shape} and {slots.shape}")


def encode(
    x: jax.Array,
    weights: jax.Array,
    slots: jax.Array,
    num_slots: int,
    *,
    implementation: str | None = "auto",
    config: DispatchConfig | None = None,
) -> jax.Array:
    """Scatters tokens into slots by gathering (differentiable in x and weights).

    Args:
      x: [S, M] tokens.
      weights: [k, S] weight applied to each assignment.
      slots: [k, S] int32 flat slot of each assignment; outside [0, num_slots) means dropped. Slots must be
        distinct (a routing plan guarantees it).
      num_slots: rows of the output (E * C for the capacity buffer).
      implementation: "auto", "xla", "pallas", "interpret", "tpu" or "tpu_interpret".
      config: kernel tiling (default: `default_dispatch_config`).

    Returns:
      [num_slots, M] in x's dtype; an empty slot holds zeros.
    """
    _check(x, weights, slots, "x")
    if weights.shape[1] != x.shape[0]:
        raise ValueError(f"weights [k, S] must match x's S={x.shape[0]}, got {weights.shape}")
    impl = choose(implementation, tpu=_tpu_check(implementation, num_slots, weights, x.dtype))
    cfg = config or default_dispatch_config(x.shape[1], x.dtype)
    return _encode(impl, cfg, x, weights, slots, int(num_slots))


def decode(
    data: jax.Array,
    weights: jax.Array,
    slots: jax.Array,
    *,
    implementation: str | None = "auto",
    config: DispatchConfig | None = None,
) -> jax.Array:
    """Combines slot rows back into tokens (differentiable in data and weights).

    Args:
      data: [num_slots, M] expert outputs.
      weights: [k, S] combine weights.
      slots: [k, S] int32 flat slots; out of range means dropped (contributes zero).
      implementation: "auto", "xla", "pallas", "interpret", "tpu" or "tpu_interpret".
      config: kernel tiling (default: `default_dispatch_config`).

    Returns:
      [S, M] in data's dtype, `y[s] = sum_j weights[j, s] * data[slots[j, s]]` (the kernel accumulates in
      float32; the reference, like Tutel, in data's dtype).
    """
    _check(data, weights, slots, "data")
    impl = choose(implementation, tpu=_tpu_check(implementation, data.shape[0], weights, data.dtype))
    cfg = config or default_dispatch_config(data.shape[1], data.dtype)
    return _decode(impl, cfg, data, weights, slots)


def permute(x: jax.Array, weights: jax.Array, rows: jax.Array, *, implementation: str | None = "auto",
            config: DispatchConfig | None = None) -> jax.Array:
    """Dropless dispatch: [S, M] -> [k*S, M] rows sorted by expert (`rows` from `grouped_rows`).

    `weights` scales each copy (pass ones for Tutel's postscore mode)."""
    return encode(x, weights, rows, weights.size, implementation=implementation, config=config)


def unpermute(y: jax.Array, weights: jax.Array, rows: jax.Array, *, implementation: str | None = "auto",
              config: DispatchConfig | None = None) -> jax.Array:
    """Dropless combine: [k*S, M] expert outputs sorted by expert -> [S, M]."""
    return decode(y, weights, rows, implementation=implementation, config=config)
