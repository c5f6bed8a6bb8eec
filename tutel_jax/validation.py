"""Argument checks shared by the layer's entry points (`make_config`, `moe_apply`, the parallel paths), so that
each rule and its error message lives in one place."""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["check_capacity_factor", "check_input"]


def check_capacity_factor(value: Any, name: str = "capacity_factor") -> float:
    """`value` as a float, or ValueError naming `name`: a capacity factor is a finite real number.

    Python and NumPy ints and floats pass; bools (`True` would silently mean 1.0), strings (even '1.5'), None,
    arrays and non-finite values do not. The sign keeps Tutel's meaning: > 0 fixed, 0 dropless, < 0 bounded.
    """
    ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    if ok:
        value = float(value)
        ok = math.isfinite(value)
    if not ok:
        raise ValueError(f"{name} must be a finite number (int or float; > 0 fixed capacity, 0 dropless, < 0 "
                         f"bounded dropless), got {value!r}")
    return value


def check_input(x: Any, model_dim: int, *, min_ndim: int = 1) -> None:
    """Raises unless `x` is the layer's input: a floating-point array [..., model_dim] with >= `min_ndim` axes.

    TypeError for a non-floating dtype (an integer or bool input would be cast to the compute dtype silently,
    e.g. token ids instead of their embeddings); ValueError for a wrong shape.
    """
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"x must have a floating dtype (float32, bfloat16, float16, ...), got "
                        f"{'no dtype: ' + type(x).__name__ if dtype is None else jnp.dtype(dtype).name}")
    if x.ndim < min_ndim or x.shape[-1] != model_dim:
        layout = (f"[..., model_dim={model_dim}]" if min_ndim <= 1
                  else f"[B, ..., model_dim={model_dim}] with a leading token-batch axis")
        raise ValueError(f"x must have shape {layout}, got {tuple(x.shape)}")
