"""Shared experts: a dense SwiGLU MLP that every token goes through, added to the routed experts' output.

DeepSeek-V3 / Kimi-K2 / GLM add it unweighted; Qwen2-MoE multiplies it by `sigmoid(x @ shared_expert_gate.T)`.
Chosen in the layer's `experts` dict: `experts={'type': 'swiglu', ..., 'shared': {'hidden_size': I, 'gate': True}}`.
Its parameters live in `params['shared_experts']`, replicated on every device under expert parallelism.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp

from .. import quant
from ._base import _activation
from ._linear import linear
from ..validation import check_int

__all__ = ["SharedExperts", "make_shared_experts"]


@dataclasses.dataclass(frozen=True)
class SharedExperts:
    """`y_shared = g(x) * down(act(gate(x)) * up(x))` (each projection `x @ w.T`), g = 1 or sigmoid(x @ gate.weight.T).

    Attributes:
      hidden_size: intermediate size (DeepSeek: moe_intermediate_size * n_shared_experts).
      gate: multiply by a learned sigmoid gate (Qwen2-MoE `shared_expert_gate`, weight [1, M], no bias).
      activation_fn: silu by default.

    Parameters in the HF [out, in] layout, float arrays or (with `weight_format`) quantized containers:
    gate_proj [I, M], up_proj [I, M], down_proj [M_out, I], and with `gate` also gate: {'weight': [1, M]}.
    """

    hidden_size: int
    gate: bool = False
    activation_fn: Callable[[jax.Array], jax.Array] = jax.nn.silu
    weight_format: str | None = None

    def init(self, key: jax.Array, model_dim: int, output_dim: int, dtype: Any) -> dict:
        keys = jax.random.split(key, 4)
        u = lambda k, shape, fan_in: jax.random.uniform(k, shape, jnp.float32, -fan_in ** -0.5,
                                                        fan_in ** -0.5).astype(dtype)
        params = {"gate_proj": u(keys[0], (self.hidden_size, model_dim), model_dim),
                  "up_proj": u(keys[1], (self.hidden_size, model_dim), model_dim),
                  "down_proj": u(keys[2], (output_dim, self.hidden_size), self.hidden_size)}
        if self.weight_format is not None:
            params.update({name: quant.quantize(params[name].astype(jnp.float32), self.weight_format)
                           for name in ("gate_proj", "up_proj", "down_proj")})
        if self.gate:
            params["gate"] = {"weight": u(keys[3], (1, model_dim), model_dim)}
        return params

    def apply(self, params: dict, x: jax.Array) -> jax.Array:
        """x [S, M] -> [S, M_out] in x's dtype."""
        dtype = x.dtype
        # packed weights: for a few rows on CPU the native kernel streams them; float ones are an XLA matmul in
        # x's dtype (differentiable: the layer trains)
        packed = self.weight_format is not None
        w = {n: params[n] if packed else params[n].astype(dtype) for n in ("gate_proj", "up_proj", "down_proj")}
        impl = "auto" if packed else "xla"
        h = self.activation_fn(linear(x, w["gate_proj"], impl=impl)) * linear(x, w["up_proj"], impl=impl)
        y = linear(h, w["down_proj"], impl=impl)
        if "gate" in params:
            y = y * jax.nn.sigmoid(x @ params["gate"]["weight"].astype(dtype).T)
        return y


def make_shared_experts(spec: Any) -> SharedExperts:
    """From the `experts['shared']` entry: {'hidden_size': I, 'gate': bool, 'activation_fn': 'silu'}."""
    if isinstance(spec, SharedExperts):
        return spec
    if not isinstance(spec, Mapping):
        raise ValueError(f"experts['shared'] must be a dict like {{'hidden_size': 1024, 'gate': False}}, "
                         f"got {type(spec).__name__}")
    options = dict(spec)
    unknown = sorted(set(options) - {"hidden_size", "gate", "activation_fn", "weight_format"})
    if unknown:
        raise ValueError(f"experts['shared']: unknown option(s) {unknown}; expected hidden_size, gate, activation_fn, "
                         "weight_format")
    hidden = options.get("hidden_size")
    check_int(hidden, "experts['shared']['hidden_size']", minimum=1)
    weight_format = quant.check_format(options.get("weight_format"), "experts['shared']['weight_format']")
    return SharedExperts(hidden, bool(options.get("gate", False)), _activation(options.get("activation_fn"), "silu"),
                         weight_format)
