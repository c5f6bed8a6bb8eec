"""Gates: parameters and logits of Tutel's `top` and `cosine_top` gates, and the custom-gate protocol.

A gate is a frozen dataclass that knows its routing defaults (`k`, `capacity_factor`, `gate_noise`) and two pure
functions:
  init(key, model_dim, num_experts, dtype) -> params pytree (named like Tutel's state dict under `gates.<i>.`)
  logits(params, x[S, M]) -> [S, E]
Any object with these members works as a custom gate (pass it in `gate_type` instead of a dict).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Callable, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from ..validation import check_capacity_factor

__all__ = ["Gate", "TopGate", "CosineTopGate", "GATE_TYPES", "register_gate", "make_gate", "torch_linear_init"]


@runtime_checkable
class Gate(Protocol):
    """The custom-gate protocol."""

    k: int
    capacity_factor: float
    gate_noise: float

    def init(self, key: jax.Array, model_dim: int, num_experts: int, dtype: Any) -> Any: ...

    def logits(self, params: Any, x: jax.Array) -> jax.Array: ...


def torch_linear_init(key: jax.Array, out_dim: int, in_dim: int, dtype: Any, bias: bool = True):
    """torch.nn.Linear's default init: U(-1/sqrt(in), 1/sqrt(in)) for weight [out, in] and bias [out]."""
    bound = 1.0 / math.sqrt(in_dim) if in_dim > 0 else 0.0
    kw, kb = jax.random.split(key)
    weight = jax.random.uniform(kw, (out_dim, in_dim), jnp.float32, -bound, bound).astype(dtype)
    if not bias:
        return weight, None
    return weight, jax.random.uniform(kb, (out_dim,), jnp.float32, -bound, bound).astype(dtype)


@dataclasses.dataclass(frozen=True)
class TopGate:
    """Tutel's `top` gate: `logits = x @ wg.T` with wg [E, M] and no bias; float32 when `fp32_gate`."""

    k: int = 2
    capacity_factor: float = 1.0
    gate_noise: float = 0.0
    fp32_gate: bool = False

    def init(self, key, model_dim, num_experts, dtype):
        weight, _ = torch_linear_init(key, num_experts, model_dim, jnp.float32 if self.fp32_gate else dtype, bias=False)
        return {"wg": {"weight": weight}}

    def logits(self, params, x):
        wg = params["wg"]["weight"]
        if self.fp32_gate:
            wg, x = wg.astype(jnp.float32), x.astype(jnp.float32)
        return jnp.dot(x.astype(wg.dtype), wg.T, precision=jax.lax.Precision.HIGHEST)


def _l2_normalize(v: jax.Array, axis: int) -> jax.Array:
    """torch.nn.functional.normalize: v / max(||v||, 1e-12)."""
    norm = jnp.sqrt(jnp.sum(jnp.square(v), axis=axis, keepdims=True))
    return v / jnp.maximum(norm, 1e-12)


@dataclasses.dataclass(frozen=True)
class CosineTopGate:
    """Tutel's `cosine_top` gate.

    `logits = normalize(proj(x), axis=1) @ normalize(sim_matrix, axis=0) * exp(min(temperature, ln 100))`,
    proj = Linear(M, proj_dim) with bias, sim_matrix [proj_dim, E], temperature [1] = ln(1 / init_t).
    """

    k: int = 2
    capacity_factor: float = 1.0
    gate_noise: float = 0.0
    fp32_gate: bool = False
    proj_dim: int = 256
    init_t: float = 0.5

    def init(self, key, model_dim, num_experts, dtype):
        dtype = jnp.float32 if self.fp32_gate else dtype
        kp, ks = jax.random.split(key)
        weight, bias = torch_linear_init(kp, self.proj_dim, model_dim, dtype)
        return {
            "temperature": jnp.full((1,), math.log(1.0 / self.init_t), dtype),
            "cosine_projector": {"weight": weight, "bias": bias},
            "sim_matrix": (0.01 * jax.random.normal(ks, (self.proj_dim, num_experts), jnp.float32)).astype(dtype),
        }

    def logits(self, params, x):
        proj_w = params["cosine_projector"]["weight"]
        proj_b = params["cosine_projector"]["bias"]
        sim = params["sim_matrix"]
        temperature = params["temperature"]
        if self.fp32_gate:
            x, proj_w, proj_b, sim = (a.astype(jnp.float32) for a in (x, proj_w, proj_b, sim))
            temperature = temperature.astype(jnp.float32)
        hp = jax.lax.Precision.HIGHEST
        proj = jnp.dot(x.astype(proj_w.dtype), proj_w.T, precision=hp) + proj_b
        logits = jnp.dot(_l2_normalize(proj, 1), _l2_normalize(sim, 0), precision=hp)
        scale = jnp.exp(jnp.minimum(temperature, math.log(1.0 / 0.01)))
        return logits * scale


GATE_TYPES: dict[str, Callable[..., Gate]] = {"top": TopGate, "cosine_top": CosineTopGate}


def register_gate(name: str, factory: Callable[..., Gate]) -> None:
    """Makes `{'type': name, ...}` usable in `gate_type`; `factory(**options)` must return a Gate."""
    GATE_TYPES[name] = factory


def make_gate(spec: Any, index: int = 0) -> Gate:
    """Builds a gate from one `gate_type` entry: a dict with 'type', or an object implementing `Gate`."""
    if isinstance(spec, str):  # Tutel's deprecated 'Top2Gate' spelling
        import re
        match = re.fullmatch(r"Top([0-9]+)Gate", spec)
        if not match:
            raise ValueError(f"gate_type[{index}]: unknown gate {spec!r}; expected a dict like "
                             "{'type': 'top', 'k': 2} or one of 'Top<k>Gate'")
        spec = {"type": "top", "k": int(match.group(1))}
    if not isinstance(spec, Mapping):
        if isinstance(spec, Gate):
            return _checked(spec, index)
        raise ValueError(f"gate_type[{index}] must be a dict with a 'type' key or an object with k, capacity_factor, "
                         f"gate_noise, init() and logits(); got {type(spec).__name__}")
    options = dict(spec)
    kind = options.pop("type", None)
    if kind not in GATE_TYPES:
        raise ValueError(f"gate_type[{index}]['type'] must be one of {sorted(GATE_TYPES)}, got {kind!r}")
    factory = GATE_TYPES[kind]
    if dataclasses.is_dataclass(factory):
        known = {f.name for f in dataclasses.fields(factory)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"gate_type[{index}] ({kind!r}): unknown option(s) {unknown}; expected some of {sorted(known)}")
    if "k" in options:
        k = options["k"]
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"gate_type[{index}]['k'] must be an integer >= 1, got {k!r}")
    return _checked(factory(**options), index)


def _checked(gate: Gate, index: int) -> Gate:
    """`gate` once its default capacity_factor is a number: a bad one fails here, not at the first call."""
    check_capacity_factor(gate.capacity_factor, f"gate_type[{index}]['capacity_factor']")
    return gate
