"""Gated-linear-unit experts of today's open MoE models: fused SwiGLU and GPT-OSS's clamped SwiGLU with biases.

Registered as expert types 'swiglu' and 'gpt_oss' (see `experts.EXPERT_TYPES`); both have `batched` (capacity
buffer), `grouped` (dropless, rows sorted by expert), `gathered` (dropless for a few rows) and, with float
weights, `hidden_axes` (sharded experts, tensor parallel). The math of each is written once (`apply`) over the
grouped-linear primitive (`grouped_linear`), which takes float arrays or packed quantized weights.

With `weight_format` ('fp8_block', 'mxfp4', 'nvfp4') in the experts dict (`{'type': 'swiglu', 'weight_format':
'nvfp4', ...}`) the same classes hold the weights quantized, as `pallas_kernels.quant` containers in the
checkpoint's [out, in] layout (see `grouped_linear` for why float and packed layouts differ): `grouped` runs the
dequantizing grouped matmul (`pallas_kernels.quant_gmm`: the kernel on a GPU, the float32 XLA reference
elsewhere), `batched` and `gathered` dequantize in XLA. `init` quantizes random weights (tests, benchmarks).
Quantized experts are for inference (no VJP) and cannot be sharded (`hidden_axes` is None).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from .. import quant
from ._base import Experts, _activation, register_experts
from ._grouped_linear import Batched, Gathered, Grouped, Mode
from ..native import moe_experts

__all__ = ["SwiGLUExperts", "GptOssExperts", "gpt_oss_glu"]


def _uniform(key, shape, fan_in, dtype):
    bound = fan_in ** -0.5
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)


def _random_quantized(key, shape, fan_in, weight_format):
    bound = fan_in ** -0.5
    return quant.quantize(jax.random.uniform(key, shape, jnp.float32, -bound, bound), weight_format)


class _GLUExperts(Experts):
    """What SwiGLU and GPT-OSS experts share: the three modes over `apply`, and quantized-weight handling."""

    weight_format: str | None = None

    def apply(self, params: Any, x: jax.Array, mode: Mode) -> jax.Array:
        raise NotImplementedError

    def batched(self, params, x):
        return self.apply(params, x, Batched(self.kernel_backend))

    def grouped(self, params, x, group_sizes):
        return self.apply(params, x, Grouped(group_sizes, x.shape[0], self.kernel_backend,
                                             with_rows=self._has_biases))

    def gathered(self, params, x, expert_ids):
        """x [R, M], expert_ids [R] -> [R, M_out]: row r through expert expert_ids[r] (only the R chosen
        experts' weights are read, packed ones dequantized)."""
        return self.apply(params, x, Gathered(expert_ids))

    _has_biases = False

    def native(self, params: Any, x: jax.Array, expert_ids: jax.Array, enc: jax.Array, dec: jax.Array,
               activations: str = "float32") -> jax.Array:
        """The routed experts' output [S, M_out] float32 through the native CPU kernel (`native.moe_experts`):
        x [S, M], expert_ids / enc / dec [K, S] as `dispatch.assignment_weights` gives them; activations
        'float32' or 'int8' (FP4 weights: int8 activations per block of 32, see `native.moe_experts`)."""
        raise NotImplementedError

    def _hidden_axes(self, params):
        raise NotImplementedError

    @property
    def hidden_axes(self):  # type: ignore[override]
        """Per-parameter hidden axis for sharded experts; None for quantized weights (they cannot be split)."""
        return None if self.weight_format is not None else self._hidden_axes


@dataclasses.dataclass(frozen=True)
class SwiGLUExperts(_GLUExperts):
    """SwiGLU experts: `(act(x @ W_gate) * (x @ W_up)) @ W_down`, act = silu.

    Float parameters, one fused gate/up matmul:
      gate_up_proj [E, M, 2, I]: one matmul against its [M, 2I] view, whose first I columns are the gate and the
        last I the up projection (HF per-expert `gate_proj.weight.T` and `up_proj.weight.T` stacked on axis 1);
        the hidden axis (3) can be split over devices.
      down_proj [E, I, M_out] (HF `down_proj.weight.T`).
    Quantized parameters (`weight_format`; containers in the HF [out, in] layout, gate and up apart since each
    has its own scales): gate_proj [E, I, M], up_proj [E, I, M], down_proj [E, M_out, I].
    """

    hidden_size_per_expert: int
    activation_fn: Callable[[jax.Array], jax.Array] = jax.nn.silu
    output_dim: int | None = None
    kernel_backend: str | None = None  # see `backends.kernels`: None = the compile platform's kernels
    weight_format: str | None = None

    def init(self, key, model_dim, num_experts, dtype):
        hidden, out_dim = self.hidden_size_per_expert, self.output_dim or model_dim
        if self.weight_format is not None:
            k1, k2, k3 = jax.random.split(key, 3)
            fmt = self.weight_format
            return {"gate_proj": _random_quantized(k1, (num_experts, hidden, model_dim), model_dim, fmt),
                    "up_proj": _random_quantized(k2, (num_experts, hidden, model_dim), model_dim, fmt),
                    "down_proj": _random_quantized(k3, (num_experts, out_dim, hidden), hidden, fmt)}
        k1, k2 = jax.random.split(key)
        return {"gate_up_proj": _uniform(k1, (num_experts, model_dim, 2, hidden), model_dim, dtype),
                "down_proj": _uniform(k2, (num_experts, hidden, out_dim), hidden, dtype)}

    def apply(self, params, x, mode: Mode):
        """The math, once: `down(act(gate(x)) * up(x))` (float: gate and up from one fused matmul)."""
        act = self.activation_fn
        if "gate_up_proj" in params:
            gate, up = jnp.split(mode.linear(x, params["gate_up_proj"]), 2, axis=-1)
            h = act(gate) * up
        else:
            h = act(mode.linear(x, params["gate_proj"])) * mode.linear(x, params["up_proj"])
        return mode.linear(h, params["down_proj"])

    def native_unsupported(self):
        return None if self.activation_fn is jax.nn.silu else f"the activation {self.activation_fn} (silu only)"

    def native(self, params, x, expert_ids, enc, dec, activations="float32"):
        if "gate_up_proj" in params:
            w1 = params["gate_up_proj"]
            w1 = w1.reshape(w1.shape[0], w1.shape[1], -1)  # [E, M, 2, I] -> [E, M, 2I]: gate columns first
            return moe_experts(x, expert_ids, enc, dec, w1, params["down_proj"], activations=activations)
        return moe_experts(x, expert_ids, enc, dec, params["gate_proj"], params["down_proj"], up=params["up_proj"],
                           activations=activations)

    def _hidden_axes(self, params):
        return {"gate_up_proj": 3, "down_proj": 1}


def gpt_oss_glu(h: jax.Array, alpha: float = 1.702, limit: float = 7.0) -> jax.Array:
    """GPT-OSS's clamped SwiGLU on interleaved pre-activations h [..., 2I] (gate = even, up = odd columns):
    `gate = min(gate, limit)`, `up = clip(up, -limit, limit)`, `(up + 1) * gate * sigmoid(alpha * gate)`."""
    gate, up = h[..., ::2], h[..., 1::2]
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


@dataclasses.dataclass(frozen=True)
class GptOssExperts(_GLUExperts):
    """GPT-OSS experts: `gpt_oss_glu(x @ gate_up_proj + gate_up_proj_bias) @ down_proj + down_proj_bias`.

    Float parameters, in the checkpoint's own layout ([in, out], gate/up interleaved):
      gate_up_proj [E, M, 2I], gate_up_proj_bias [E, 2I], down_proj [E, I, M_out], down_proj_bias [E, M_out].
    Quantized (`weight_format`): gate_up_proj container [E, 2I, M] (gate/up interleaved on the out axis),
    down_proj container [E, M_out, I]; the biases stay float.
    Attributes: swiglu_alpha (1.702), swiglu_limit (7.0; the config's `swiglu_limit`).
    """

    hidden_size_per_expert: int
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    output_dim: int | None = None
    kernel_backend: str | None = None  # see `backends.kernels`: None = the compile platform's kernels
    weight_format: str | None = None

    _has_biases = True

    def init(self, key, model_dim, num_experts, dtype):
        hidden, out_dim = self.hidden_size_per_expert, self.output_dim or model_dim
        k1, k2, k3, k4 = jax.random.split(key, 4)
        fmt = self.weight_format
        if fmt is not None:
            gate_up = _random_quantized(k1, (num_experts, 2 * hidden, model_dim), model_dim, fmt)
            down = _random_quantized(k3, (num_experts, out_dim, hidden), hidden, fmt)
        else:
            gate_up = _uniform(k1, (num_experts, model_dim, 2 * hidden), model_dim, dtype)
            down = _uniform(k3, (num_experts, hidden, out_dim), hidden, dtype)
        return {"gate_up_proj": gate_up, "gate_up_proj_bias": _uniform(k2, (num_experts, 2 * hidden), model_dim, dtype),
                "down_proj": down, "down_proj_bias": _uniform(k4, (num_experts, out_dim), hidden, dtype)}

    def apply(self, params, x, mode: Mode):
        """The math, once: `glu(x @ gate_up + b1) @ down + b2`."""
        h = mode.linear(x, params["gate_up_proj"])
        h = h + mode.bias(params["gate_up_proj_bias"], x.dtype)
        y = mode.linear(gpt_oss_glu(h, self.swiglu_alpha, self.swiglu_limit), params["down_proj"])
        return y + mode.bias(params["down_proj_bias"], x.dtype)

    def native(self, params, x, expert_ids, enc, dec, activations="float32"):
        return moe_experts(x, expert_ids, enc, dec, params["gate_up_proj"], params["down_proj"],
                           b1=params["gate_up_proj_bias"], b2=params["down_proj_bias"], glu="gpt_oss",
                           alpha=self.swiglu_alpha, limit=self.swiglu_limit, activations=activations)

    def _hidden_axes(self, params):
        # interleaved gate/up: each contiguous block of 2I/r columns holds whole (gate, up) pairs
        return {"gate_up_proj": 2, "gate_up_proj_bias": 1, "down_proj": 1, "down_proj_bias": None}


def _swiglu_factory(hidden_size_per_expert, activation_fn=None, output_dim=None, kernel_backend=None,
                    weight_format=None):
    return SwiGLUExperts(hidden_size_per_expert, _activation(activation_fn, "silu"), output_dim, kernel_backend,
                         quant.check_format(weight_format, "experts['weight_format']"))


def _gpt_oss_factory(hidden_size_per_expert, swiglu_limit=7.0, swiglu_alpha=1.702, output_dim=None,
                     kernel_backend=None, weight_format=None):
    for name, value in (("swiglu_limit", swiglu_limit), ("swiglu_alpha", swiglu_alpha)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"experts['{name}'] must be a positive number, got {value!r}")
    return GptOssExperts(hidden_size_per_expert, float(swiglu_alpha), float(swiglu_limit), output_dim,
                         kernel_backend, quant.check_format(weight_format, "experts['weight_format']"))


register_experts("swiglu", _swiglu_factory)
register_experts("gpt_oss", _gpt_oss_factory)
