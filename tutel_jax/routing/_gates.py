"""Gates: the `Gate` protocol every gate implements, Tutel's `top` and `cosine_top` gates, and `make_gate`.

A gate is a frozen dataclass that knows its routing defaults (`k`, `capacity_factor`, `gate_noise`) and two pure
functions:
  init(key, model_dim, num_experts, dtype) -> params pytree (named like Tutel's state dict under `gates.<i>.`)
  logits(params, x[S, M]) -> [S, E]
and, with defaults in the `Gate` base class, everything else the routing pipeline (`routing.pipeline`) uses: how
it selects experts (`selection`: Tutel's softmax top-k, a router's `select`, or an expert-choice `plan`), the
training-time `jitter`, the loss it reports (`aux_loss`, `z_loss_weight`) and how the fused gating kernel
reproduces it (`kernel_gating`, `choices_for_ids`).

Custom gates: subclass `Gate`, or pass any object with the five members of `MinimalGate` (the original protocol:
k, capacity_factor, gate_noise, init, logits) in `gate_type`; `make_gate` wraps the latter in a `GateAdapter`,
which supplies the defaults and uses the optional members (select, plan, jitter, ...) the object defines.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any, Callable, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from ..validation import check_capacity_factor, check_choice, check_int

__all__ = ["Gate", "MinimalGate", "GateAdapter", "as_gate", "TopGate", "CosineTopGate", "GATE_TYPES",
           "register_gate", "make_gate", "torch_linear_init", "TUTEL", "SELECT", "PLAN"]

# how a gate chooses experts (`Gate.selection`)
TUTEL = "tutel"    # Tutel's top-k of softmax(logits) in the logits' dtype, weights per `normalize_gate`
SELECT = "select"  # a router: `select(params, logits, k) -> RouterChoices`, then Tutel's slots and capacity
PLAN = "plan"      # the gate builds the plan itself: `plan(params, logits, cf, ...)` (expert choice)


class Gate:
    """Base class of every gate: everything the routing pipeline uses, with defaults.

    Required (dataclass fields in the built-in gates):
      k: default experts per token; capacity_factor: default capacity factor (Tutel's rules);
      init(key, model_dim, num_experts, dtype) -> params; logits(params, x [S, M]) -> [S, E].

    Optional, defaults here:
      gate_noise: training-time additive logit noise `gate_noise * N(0, 1) / E` (0: none).
      jitter: training-time multiplicative input jitter `x * U(1 - jitter, 1 + jitter)` (0: none).
      aux_loss: a router's `l_aux`: 'switch', 'gshard', 'seq_aux' or 'none'; None: 'switch' for `select`
        routers, 'none' for `plan` gates. Tutel's gates (selection 'tutel') use `config.is_gshard_loss` instead.
      z_loss_weight: a router's `l_aux += z_loss_weight * z_loss`.
      needs_rng (property): gate_noise > 0 or jitter > 0, i.e. training-mode calls need an `rng` key.
      selection: TUTEL, SELECT or PLAN. Derived for each subclass: PLAN when it defines `plan`, SELECT when it
        defines `select`, else TUTEL (unless the class sets it).
      select(params, logits, k) -> RouterChoices: a router's choices (SELECT).
      plan(params, logits, capacity_factor, *, alignment, valid, num_tokens_for_capacity) -> (RoutingPlan, probs)
        (PLAN).
      kernel_gating(params, k, num_experts) -> dict | None: the `pallas_kernels.gating` keyword arguments under
        which the fused kernel picks exactly `select`'s experts, or None (the default) when it cannot (SELECT).
      choices_for_ids(params, logits, expert_ids) -> RouterChoices: `select`'s weights and probs for given
        experts, differentiable in the logits (SELECT gates with `kernel_gating`).
    """

    k: int
    capacity_factor: float
    gate_noise: float = 0.0
    jitter: float = 0.0
    aux_loss: str | None = None
    z_loss_weight: float = 0.0
    selection: str = TUTEL

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "selection" not in cls.__dict__:
            cls.selection = (PLAN if cls.plan is not Gate.plan else
                             SELECT if cls.select is not Gate.select else TUTEL)

    @property
    def needs_rng(self) -> bool:
        """Whether a training-mode call needs an `rng` key: gate noise or input jitter is on."""
        return float(self.gate_noise or 0.0) > 0 or float(self.jitter or 0.0) > 0

    def init(self, key: jax.Array, model_dim: int, num_experts: int, dtype: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define init()")

    def logits(self, params: Any, x: jax.Array) -> jax.Array:
        raise NotImplementedError(f"{type(self).__name__} must define logits()")

    def select(self, params: Any, logits: jax.Array, k: int):
        raise NotImplementedError(f"{type(self).__name__} has no select() (selection {self.selection!r})")

    def plan(self, params: Any, logits: jax.Array, capacity_factor: float, *, alignment: int = 1,
             valid: jax.Array | None = None, num_tokens_for_capacity: int | None = None):
        raise NotImplementedError(f"{type(self).__name__} has no plan() (selection {self.selection!r})")

    def kernel_gating(self, params: Any, k: int, num_experts: int) -> dict | None:
        return None

    def choices_for_ids(self, params: Any, logits: jax.Array, expert_ids: jax.Array):
        raise NotImplementedError(f"{type(self).__name__} has no kernel gating")


@runtime_checkable
class MinimalGate(Protocol):
    """The original custom-gate protocol: what an object needs to be usable as a gate (see `GateAdapter`)."""

    k: int
    capacity_factor: float
    gate_noise: float

    def init(self, key: jax.Array, model_dim: int, num_experts: int, dtype: Any) -> Any: ...

    def logits(self, params: Any, x: jax.Array) -> jax.Array: ...


@dataclasses.dataclass(frozen=True)
class GateAdapter(Gate):
    """A custom gate written against `MinimalGate` as a full `Gate`.

    The optional members the wrapped object defines are used as they always were: `plan` or `select` make it
    an expert-choice gate or a router (then `jitter`, `aux_loss`, `z_loss_weight`, `kernel_gating` and
    `choices_for_ids` count when present); without them it is routed like Tutel's gates (and any `jitter` is
    ignored, as before). Other attributes are read through to the wrapped gate.

    `k`, `capacity_factor` and `gate_noise` are fields, taken from the wrapped gate by default, so that
    `dataclasses.replace(adapter, k=...)` works; a wrapped dataclass gate with that field is replaced with them.
    """

    gate: Any
    k: int = None
    capacity_factor: float = None
    gate_noise: float = None

    def __post_init__(self):
        inner = self.gate
        for name in ("k", "capacity_factor", "gate_noise"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(inner, name))
        if dataclasses.is_dataclass(inner) and not isinstance(inner, type):
            fields = {f.name for f in dataclasses.fields(inner)}
            changes = {name: getattr(self, name) for name in ("k", "capacity_factor", "gate_noise")
                       if name in fields and getattr(inner, name) != getattr(self, name)}
            if changes:
                object.__setattr__(self, "gate", dataclasses.replace(inner, **changes))

    def __getattr__(self, name):  # only for names the adapter lacks: the wrapped gate's own attributes
        if name.startswith("__") or name == "gate":
            raise AttributeError(name)
        return getattr(self.gate, name)

    def _member(self, name: str, default: Any) -> Any:
        return getattr(self.gate, name, default)

    @property
    def selection(self) -> str:
        if callable(self._member("plan", None)):
            return PLAN
        return SELECT if callable(self._member("select", None)) else TUTEL

    @property
    def jitter(self) -> float:
        return self._member("jitter", 0.0) if self.selection != TUTEL else 0.0

    @property
    def aux_loss(self) -> str | None:
        return self._member("aux_loss", None)

    @property
    def z_loss_weight(self) -> float:
        return self._member("z_loss_weight", 0.0)

    def init(self, key, model_dim, num_experts, dtype):
        return self.gate.init(key, model_dim, num_experts, dtype)

    def logits(self, params, x):
        return self.gate.logits(params, x)

    def select(self, params, logits, k):
        return self.gate.select(params, logits, k)

    def plan(self, params, logits, capacity_factor, **kwargs):
        return self.gate.plan(params, logits, capacity_factor, **kwargs)

    def kernel_gating(self, params, k, num_experts):
        describe = self._member("kernel_gating", None)
        return describe(params, k, num_experts) if callable(describe) else None

    def choices_for_ids(self, params, logits, expert_ids):
        return self.gate.choices_for_ids(params, logits, expert_ids)


def as_gate(gate: Any) -> Gate:
    """`gate` itself when it is a `Gate`, else wrapped in a `GateAdapter` (an object with the `MinimalGate`
    members)."""
    return gate if isinstance(gate, Gate) else GateAdapter(gate)


def torch_linear_init(key: jax.Array, out_dim: int, in_dim: int, dtype: Any, bias: bool = True):
    """torch.nn.Linear's default init: U(-1/sqrt(in), 1/sqrt(in)) for weight [out, in] and bias [out]."""
    bound = 1.0 / math.sqrt(in_dim) if in_dim > 0 else 0.0
    kw, kb = jax.random.split(key)
    weight = jax.random.uniform(kw, (out_dim, in_dim), jnp.float32, -bound, bound).astype(dtype)
    if not bias:
        return weight, None
    return weight, jax.random.uniform(kb, (out_dim,), jnp.float32, -bound, bound).astype(dtype)


@dataclasses.dataclass(frozen=True)
class TopGate(Gate):
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
        return jnp.einsum("...m,em->...e", x.astype(wg.dtype), wg, precision=jax.lax.Precision.HIGHEST)


def _l2_normalize(v: jax.Array, axis: int) -> jax.Array:
    """torch.nn.functional.normalize: v / max(||v||, 1e-12)."""
    norm = jnp.sqrt(jnp.sum(jnp.square(v), axis=axis, keepdims=True))
    return v / jnp.maximum(norm, 1e-12)


@dataclasses.dataclass(frozen=True)
class CosineTopGate(Gate):
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
    """Makes `{'type': name, ...}` usable in `gate_type`; `factory(**options)` must return a Gate (or an object
    with the `MinimalGate` members, which `make_gate` wraps)."""
    GATE_TYPES[name] = factory


def make_gate(spec: Any, index: int = 0) -> Gate:
    """Builds a gate from one `gate_type` entry: a dict with 'type', a `Gate`, or an object with the
    `MinimalGate` members (returned wrapped in a `GateAdapter`)."""
    if isinstance(spec, str):  # Tutel's deprecated 'Top2Gate' spelling
        match = re.fullmatch(r"Top([0-9]+)Gate", spec)
        if not match:
            raise ValueError(f"gate_type[{index}]: unknown gate {spec!r}; expected a dict like "
                             "{'type': 'top', 'k': 2} or one of 'Top<k>Gate'")
        spec = {"type": "top", "k": int(match.group(1))}
    if not isinstance(spec, Mapping):
        if isinstance(spec, (Gate, MinimalGate)):
            return _checked(spec, index)
        raise ValueError(f"gate_type[{index}] must be a dict with a 'type' key or an object with k, capacity_factor, "
                         f"gate_noise, init() and logits(); got {type(spec).__name__}")
    options = dict(spec)
    kind = options.pop("type", None)
    check_choice(kind, f"gate_type[{index}]['type']", sorted(GATE_TYPES))
    factory = GATE_TYPES[kind]
    if dataclasses.is_dataclass(factory):
        known = {f.name for f in dataclasses.fields(factory)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"gate_type[{index}] ({kind!r}): unknown option(s) {unknown}; expected some of {sorted(known)}")
    if "k" in options:
        k = options["k"]
        check_int(k, f"gate_type[{index}]['k']", minimum=1)
    return _checked(factory(**options), index)


def _checked(gate: Any, index: int) -> Gate:
    """`gate` as a full `Gate` (`as_gate`) once its default capacity_factor is a number: a bad one fails here,
    not at the first call."""
    check_capacity_factor(gate.capacity_factor, f"gate_type[{index}]['capacity_factor']")
    return as_gate(gate)
