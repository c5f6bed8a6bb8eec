"""Expert networks: Tutel's `ffn`, `llama_ffn` (SwiGLU), the `Experts` contract, and custom experts.

An expert type is an `Experts` (a frozen dataclass of pure functions); every member the layer uses is declared
on the base class, with a default:
  init(key, model_dim, num_experts, dtype) -> params pytree (named like Tutel's state dict under `experts.`)
  batched(params, x[E, C, M]) -> [E, C, M_out]              (capacity buffer path)                   required
  grouped(params, x[T, M], group_sizes[E]) -> [T, M_out]     (dropless; rows sorted by expert)  None: absent
  gathered(params, x[R, M], expert_ids[R]) -> [R, M_out]     (dropless 'gather': row r via expert ids[r])
  hidden_axes(params) -> same pytree of ints / None          (sharded experts)                  None: absent
  native(params, x[S, M], ids, enc, dec [K, S], activations) -> [S, M_out] (dropless 'native' / 'native_int8': the
                                                             C++ CPU kernel)                   None: absent
  output_dim (None: model_dim), kernel_backend (None), hidden_size_per_expert (None), num_local_experts (1)
  supports(name) -> whether the optional method `name` ('grouped', 'gathered', 'hidden_axes', 'native') is there.
`hidden_axes` names, per parameter, the axis that indexes hidden units (so an expert can be split over devices:
sharded experts); None marks an output bias, added once.

The built-in types write their math once (`apply(params, x, mode)`) over the grouped-linear primitive
(`grouped_linear`: float or packed quantized weights, XLA / Pallas backends), run as `Batched`, `Grouped` or
`Gathered`.

Custom experts: an `Experts` subclass, or any object with `init` and `batched` (the old minimal protocol; it
may also have `grouped`, `gathered`, `hidden_axes`, `output_dim`, `kernel_backend`, `num_local_experts`),
which `make_config` wraps in `AdaptedExperts` (`as_experts`) so that it answers the whole contract.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any, Callable, ClassVar, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from ._grouped_linear import Batched, Gathered, Grouped, Mode
from ..validation import check_choice, check_int

__all__ = ["Experts", "MinimalExperts", "AdaptedExperts", "as_experts", "FFNExperts", "LlamaFFNExperts",
           "EXPERT_TYPES", "register_experts", "make_experts", "ACTIVATIONS"]

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


OPTIONAL_METHODS = ("grouped", "gathered", "hidden_axes", "native")


@runtime_checkable
class MinimalExperts(Protocol):
    """The old custom-expert protocol (`init` + `batched`): what an object needs to be wrapped by `as_experts`."""

    def init(self, key: jax.Array, model_dim: int, num_experts: int, dtype: Any) -> Any: ...

    def batched(self, params: Any, x: jax.Array) -> jax.Array: ...


class Experts:
    """The expert contract: every member the layer reads, with its default (see the module docstring).

    `grouped`, `gathered`, `hidden_axes` and `native` are None unless a subclass defines them (methods); callers
    test `experts.grouped is not None` or `experts.supports('grouped')`."""

    grouped: ClassVar[Callable[..., jax.Array] | None] = None
    gathered: ClassVar[Callable[..., jax.Array] | None] = None
    hidden_axes: ClassVar[Callable[[Any], Any] | None] = None
    native: ClassVar[Callable[..., jax.Array] | None] = None
    output_dim: int | None = None  # None: the layer's model_dim
    kernel_backend: str | None = None  # see `backends.kernels`: None = the compile platform's kernels
    hidden_size_per_expert: int | None = None
    num_local_experts: int = 1  # read by make_config for an object passed as `experts` (a dict has count_per_node)

    def init(self, key: jax.Array, model_dim: int, num_experts: int, dtype: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.init")

    def batched(self, params: Any, x: jax.Array) -> jax.Array:
        raise NotImplementedError(f"{type(self).__name__}.batched")

    def native_unsupported(self) -> str | None:
        """Why `native` cannot run these experts as configured (None: it can, when the class has it)."""
        return None

    def supports(self, method: str) -> bool:
        """Whether the optional method `method` ('grouped', 'gathered', 'hidden_axes', 'native') is available."""
        if method not in OPTIONAL_METHODS:
            raise ValueError(f"supports(): one of {OPTIONAL_METHODS}, got {method!r}")
        return callable(getattr(self, method))

    @property
    def type_name(self) -> str:
        """The expert type's class name, for messages (a wrapped object's own)."""
        return type(self).__name__

    def with_kernel_backend(self, backend: str | None) -> "Experts":
        """The same experts with `kernel_backend = backend` (a dataclass field; unchanged when there is none)."""
        if dataclasses.is_dataclass(self) and "kernel_backend" in {f.name for f in dataclasses.fields(self)}:
            return dataclasses.replace(self, kernel_backend=backend)
        return self


def _adapted(name: str, default: Any = None) -> property:
    return property(lambda self: getattr(self.inner, name, default), doc=f"the wrapped object's `{name}`")


@dataclasses.dataclass(frozen=True)
class AdaptedExperts(Experts):
    """An object written against the minimal protocol (`init` + `batched`, optionally more) as an `Experts`:
    members it lacks take the defaults; any other attribute is read from it (`inner`)."""

    inner: Any

    grouped = _adapted("grouped")  # type: ignore[assignment]
    gathered = _adapted("gathered")  # type: ignore[assignment]
    hidden_axes = _adapted("hidden_axes")  # type: ignore[assignment]
    output_dim = _adapted("output_dim")  # type: ignore[assignment]
    kernel_backend = _adapted("kernel_backend")  # type: ignore[assignment]
    hidden_size_per_expert = _adapted("hidden_size_per_expert")  # type: ignore[assignment]
    num_local_experts = _adapted("num_local_experts", 1)  # type: ignore[assignment]

    def init(self, key, model_dim, num_experts, dtype):
        return self.inner.init(key, model_dim, num_experts, dtype)

    def batched(self, params, x):
        return self.inner.batched(params, x)

    @property
    def type_name(self) -> str:
        return type(self.inner).__name__

    def with_kernel_backend(self, backend):
        inner = self.inner
        if dataclasses.is_dataclass(inner) and "kernel_backend" in {f.name for f in dataclasses.fields(inner)}:
            return AdaptedExperts(dataclasses.replace(inner, kernel_backend=backend))
        return self

    def __getattr__(self, name: str) -> Any:  # anything else the custom object has
        if name == "inner" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def as_experts(obj: Any) -> Experts:
    """`obj` as an `Experts`: itself when it is one, else wrapped in `AdaptedExperts` (it needs `init` and
    `batched`); ValueError otherwise."""
    if isinstance(obj, Experts):
        return obj
    if not isinstance(obj, MinimalExperts):
        raise ValueError(f"experts must be a dict or an object with init() and batched(), got {type(obj).__name__}")
    return AdaptedExperts(obj)


@dataclasses.dataclass(frozen=True)
class FFNExperts(Experts):
    """Tutel's `ffn`: `act(x @ W1.T + b1) @ W2 + b2` per expert.

    Parameters (Tutel layout): batched_fc1_w [E, H, M], batched_fc2_w [E, H, M_out] (used as [H, M_out]),
    batched_fc1_bias [E, H], batched_fc2_bias [E, M_out]; biases optional. Default activation: relu.
    """

    hidden_size_per_expert: int
    activation_fn: Callable[[jax.Array], jax.Array] = jax.nn.relu
    has_fc1_bias: bool = True
    has_fc2_bias: bool = True
    output_dim: int | None = None
    kernel_backend: str | None = None  # see `backends.kernels`: None = the compile platform's kernels

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

    def apply(self, params, x, mode: Mode):
        """The math, once: fc1 (Tutel's [E, H, M]: [out, in]), bias, act, fc2 (Tutel's [E, H, M_out]: [in, out]),
        bias."""
        h = mode.linear(x, params["batched_fc1_w"])
        if "batched_fc1_bias" in params:
            h = h + mode.bias(params["batched_fc1_bias"], h.dtype)
        h = self.activation_fn(h)
        y = mode.linear(h, params["batched_fc2_w"], in_out=True)
        if "batched_fc2_bias" in params:
            y = y + mode.bias(params["batched_fc2_bias"], y.dtype)
        return y

    def batched(self, params, x):
        return self.apply(params, x, Batched(self.kernel_backend))

    def grouped(self, params, x, group_sizes):
        return self.apply(params, x, Grouped(group_sizes, x.shape[0], self.kernel_backend, with_rows=True))

    def gathered(self, params, x, expert_ids):
        return self.apply(params, x, Gathered(expert_ids))

    def hidden_axes(self, params):
        axes = {"batched_fc1_w": 1, "batched_fc2_w": 1, "batched_fc1_bias": 1, "batched_fc2_bias": None}
        return {k: axes[k] for k in params}


@dataclasses.dataclass(frozen=True)
class LlamaFFNExperts(Experts):
    """Tutel's `llama_ffn` (SwiGLU): `(act(x @ W_fc1) * (x @ W_fc2)) @ W_fc3`, act = silu by default.

    Parameters (Tutel layout): W_fc1 [E, M, H] (gate), W_fc2 [E, M, H] (up), W_fc3 [E, H, M] (down); init N(0, 0.01).
    """

    hidden_size_per_expert: int
    activation_fn: Callable[[jax.Array], jax.Array] = jax.nn.silu
    kernel_backend: str | None = None  # see `backends.kernels`: None = the compile platform's kernels

    def init(self, key, model_dim, num_experts, dtype):
        k1, k2, k3 = jax.random.split(key, 3)
        hidden = self.hidden_size_per_expert
        normal = lambda k, shape: (0.01 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
        return {
            "W_fc1": normal(k1, (num_experts, model_dim, hidden)),
            "W_fc2": normal(k2, (num_experts, model_dim, hidden)),
            "W_fc3": normal(k3, (num_experts, hidden, model_dim)),
        }

    def apply(self, params, x, mode: Mode):
        """The math, once: `(act(x @ W_fc1) * (x @ W_fc2)) @ W_fc3` (Tutel's [in, out] weights)."""
        gate = mode.linear(x, params["W_fc1"], in_out=True)
        up = mode.linear(x, params["W_fc2"], in_out=True)
        return mode.linear(self.activation_fn(gate) * up, params["W_fc3"], in_out=True)

    def batched(self, params, x):
        return self.apply(params, x, Batched(self.kernel_backend))

    def grouped(self, params, x, group_sizes):
        return self.apply(params, x, Grouped(group_sizes, x.shape[0], self.kernel_backend))

    def gathered(self, params, x, expert_ids):
        return self.apply(params, x, Gathered(expert_ids))

    def hidden_axes(self, params):
        return {"W_fc1": 2, "W_fc2": 2, "W_fc3": 1}


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
    """Makes `experts={'type': name, ...}` usable; `factory(**options)` must return an Experts object (or one with
    `init` and `batched`, wrapped by `as_experts`)."""
    EXPERT_TYPES[name] = factory


def make_experts(spec: Mapping) -> Experts:
    """Builds the expert network from Tutel's `experts` dict (placement keys are read elsewhere)."""
    kind = spec.get("type")
    check_choice(kind, "experts['type']", sorted(EXPERT_TYPES))
    options = {k: v for k, v in spec.items() if k not in PLACEMENT_KEYS}
    if "hidden_size_per_expert" in options:
        hidden = options["hidden_size_per_expert"]
        check_int(hidden, "experts['hidden_size_per_expert']", minimum=1)
    factory = EXPERT_TYPES[kind]
    try:
        net = factory(**options)
    except TypeError as err:
        expected = list(inspect.signature(factory).parameters)
        raise ValueError(f"experts ({kind!r}): bad options {sorted(options)}; expected some of {expected} "
                         f"({err})") from None
    return as_experts(net)  # a registered factory may return an object of the minimal protocol
