"""Expert networks: Tutel's `ffn`, `llama_ffn` (SwiGLU), and the custom-expert protocol.

An expert type is a frozen dataclass with pure functions:
  init(key, model_dim, num_experts, dtype) -> params pytree (named like Tutel's state dict under `experts.`)
  batched(params, x[E, C, M]) -> [E, C, M_out]          (capacity buffer path)
  grouped(params, x[T, M], group_sizes[E]) -> [T, M_out] (dropless path; rows sorted by expert) -- optional
  hidden_axes(params) -> same pytree of ints / None                          -- optional
Any object with `init` and `batched` (and optionally `grouped`) works as a custom expert. `hidden_axes` names,
per parameter, the axis that indexes hidden units (so an expert can be split over devices: sharded experts);
None marks an output bias, added once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from .dispatch import group_row_experts

__all__ = ["Experts", "FFNExperts", "LlamaFFNExperts", "EXPERT_TYPES", "register_experts", "make_experts",
           "ACTIVATIONS"]

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
    "identity": lambda x: x,
}


def _activation(fn: str | Callable | None, default: str) -> Callable[[jax.Array], jax.Array]:
    if fn is None:
        return ACTIVATIONS[default]
    if isinstance(fn, str):
        if fn not in ACTIVATIONS:
            raise ValueError(f"experts['activation_fn'] must be a callable or one of {sorted(ACTIVATIONS)}, got {fn!r}")
        return ACTIVATIONS[fn]
    if not callable(fn):
        raise ValueError(f"experts['activation_fn'] must be callable, got {type(fn).__name__}")
    return fn


@runtime_checkable
class Experts(Protocol):
    """The custom-expert protocol (`grouped` is optional; without it the dropless path is unavailable)."""

    def init(self, key: jax.Array, model_dim: int, num_experts: int, dtype: Any) -> Any: ...

    def batched(self, params: Any, x: jax.Array) -> jax.Array: ...


def _grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, backend: str | None = None) -> jax.Array:
    """[T, K] x [E, K, N] with rows grouped by expert -> [T, N].

    backend None: `lax.ragged_dot`. Otherwise `pallas_kernels.gmm(..., implementation=backend)` ("auto": the
    Pallas kernel on a GPU, the XLA reference elsewhere; "pallas", "interpret", "xla").
    """
    if backend is None:
        return jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes)
    from pallas_kernels import gmm  # lazy: the default path does not need the kernels package
    return gmm(x, w.astype(x.dtype), group_sizes, implementation=backend)


@dataclasses.dataclass(frozen=True)
class FFNExperts:
    """Tutel's `ffn`: `act(x @ W1.T + b1) @ W2 + b2` per expert.

    Parameters (Tutel layout): batched_fc1_w [E, H, M], batched_fc2_w [E, H, M_out] (used as [H, M_out]),
    batched_fc1_bias [E, H], batched_fc2_bias [E, M_out]; biases optional. Default activation: relu.
    """

    hidden_size_per_expert: int
    activation_fn: Callable[[jax.Array], jax.Array] = jax.nn.relu
    has_fc1_bias: bool = True
    has_fc2_bias: bool = True
    output_dim: int | None = None
    kernel_backend: str | None = None  # grouped(): None = lax.ragged_dot, else pallas_kernels.gmm implementation

    def init(self, key, model_dim, num_experts, dtype):
        out_dim = self.output_dim or model_dim
        hidden = self.hidden_size_per_expert
        # Tutel fills each expert from fresh torch Linear layers: fc1 = Linear(M, H), fc2 = Linear(H, M_out).T,
        # i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases alike.
        k1, k2, k3, k4 = jax.random.split(key, 4)
        uniform = lambda k, shape, fan_in: jax.random.uniform(
            k, shape, jnp.float32, -fan_in ** -0.5, fan_in ** -0.5).astype(dtype)
        params = {
            "batched_fc1_w": uniform(k1, (num_experts, hidden, model_dim), model_dim),
            "batched_fc2_w": uniform(k2, (num_experts, hidden, out_dim), hidden),
        }
        if self.has_fc1_bias:
            params["batched_fc1_bias"] = uniform(k3, (num_experts, hidden), model_dim)
        if self.has_fc2_bias:
            params["batched_fc2_bias"] = uniform(k4, (num_experts, out_dim), hidden)
        return params

    def batched(self, params, x):
        dtype = x.dtype
        h = jnp.einsum("ecm,ehm->ech", x, params["batched_fc1_w"].astype(dtype))
        if "batched_fc1_bias" in params:
            h = h + params["batched_fc1_bias"][:, None, :].astype(dtype)
        h = self.activation_fn(h)
        y = jnp.einsum("ech,ehm->ecm", h, params["batched_fc2_w"].astype(dtype))
        if "batched_fc2_bias" in params:
            y = y + params["batched_fc2_bias"][:, None, :].astype(dtype)
        return y

    def hidden_axes(self, params):
        axes = {"batched_fc1_w": 1, "batched_fc2_w": 1, "batched_fc1_bias": 1, "batched_fc2_bias": None}
        return {k: axes[k] for k in params}

    def grouped(self, params, x, group_sizes):
        rows = group_row_experts(group_sizes, x.shape[0])
        h = _grouped_matmul(x, jnp.swapaxes(params["batched_fc1_w"], 1, 2), group_sizes, self.kernel_backend)
        if "batched_fc1_bias" in params:
            h = h + params["batched_fc1_bias"].astype(h.dtype)[rows]
        h = self.activation_fn(h)
        y = _grouped_matmul(h, params["batched_fc2_w"], group_sizes, self.kernel_backend)
        if "batched_fc2_bias" in params:
            y = y + params["batched_fc2_bias"].astype(y.dtype)[rows]
        return y


@dataclasses.dataclass(frozen=True)
class LlamaFFNExperts:
    """Tutel's `llama_ffn` (SwiGLU): `(act(x @ W_fc1) * (x @ W_fc2)) @ W_fc3`, act = silu by default.

    Parameters (Tutel layout): W_fc1 [E, M, H] (gate), W_fc2 [E, M, H] (up), W_fc3 [E, H, M] (down); init N(0, 0.01).
    """

    hidden_size_per_expert: int
    activation_fn: Callable[[jax.Array], jax.Array] = jax.nn.silu
    kernel_backend: str | None = None  # grouped(): None = lax.ragged_dot, else pallas_kernels.gmm implementation

    def init(self, key, model_dim, num_experts, dtype):
        k1, k2, k3 = jax.random.split(key, 3)
        hidden = self.hidden_size_per_expert
        normal = lambda k, shape: (0.01 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
        return {
            "W_fc1": normal(k1, (num_experts, model_dim, hidden)),
            "W_fc2": normal(k2, (num_experts, model_dim, hidden)),
            "W_fc3": normal(k3, (num_experts, hidden, model_dim)),
        }

    def batched(self, params, x):
        dtype = x.dtype
        gate = jnp.einsum("ecm,emh->ech", x, params["W_fc1"].astype(dtype))
        up = jnp.einsum("ecm,emh->ech", x, params["W_fc2"].astype(dtype))
        return jnp.einsum("ech,ehm->ecm", self.activation_fn(gate) * up, params["W_fc3"].astype(dtype))

    def hidden_axes(self, params):
        return {"W_fc1": 2, "W_fc2": 2, "W_fc3": 1}

    def grouped(self, params, x, group_sizes):
        backend = self.kernel_backend
        gate = _grouped_matmul(x, params["W_fc1"], group_sizes, backend)
        up = _grouped_matmul(x, params["W_fc2"], group_sizes, backend)
        return _grouped_matmul(self.activation_fn(gate) * up, params["W_fc3"], group_sizes, backend)


def _ffn_factory(hidden_size_per_expert, activation_fn=None, has_fc1_bias=True, has_fc2_bias=True, output_dim=None,
                 kernel_backend=None):
    return FFNExperts(hidden_size_per_expert, _activation(activation_fn, "relu"), bool(has_fc1_bias),
                      bool(has_fc2_bias), output_dim, kernel_backend)


def _llama_factory(hidden_size_per_expert, activation_fn=None, kernel_backend=None):
    return LlamaFFNExperts(hidden_size_per_expert, _activation(activation_fn, "silu"), kernel_backend)


EXPERT_TYPES: dict[str, Callable[..., Experts]] = {"ffn": _ffn_factory, "llama_ffn": _llama_factory}
# keys of Tutel's `experts` dict that describe placement, not the network
PLACEMENT_KEYS = ("type", "count_per_node", "num_experts_per_device")


def register_experts(name: str, factory: Callable[..., Experts]) -> None:
    """Makes `experts={'type': name, ...}` usable; `factory(**options)` must return an Experts object."""
    EXPERT_TYPES[name] = factory


def make_experts(spec: Mapping) -> Experts:
    """Builds the expert network from Tutel's `experts` dict (placement keys are read elsewhere)."""
    kind = spec.get("type")
    if kind not in EXPERT_TYPES:
        raise ValueError(f"experts['type'] must be one of {sorted(EXPERT_TYPES)}, got {kind!r}")
    options = {k: v for k, v in spec.items() if k not in PLACEMENT_KEYS}
    if "hidden_size_per_expert" in options:
        hidden = options["hidden_size_per_expert"]
        if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
            raise ValueError(f"experts['hidden_size_per_expert'] must be a positive integer, got {hidden!r}")
    factory = EXPERT_TYPES[kind]
    try:
        return factory(**options)
    except TypeError as err:
        import inspect
        expected = list(inspect.signature(factory).parameters)
        raise ValueError(f"experts ({kind!r}): bad options {sorted(options)}; expected some of {expected} "
                         f"({err})") from None
