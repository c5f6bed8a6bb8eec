"""Gated-linear-unit experts of today's open MoE models: fused SwiGLU and GPT-OSS's clamped SwiGLU with biases.

Registered as expert types 'swiglu' and 'gpt_oss' (see `experts.EXPERT_TYPES`); both have `batched` (capacity
buffer), `grouped` (dropless, rows sorted by expert), `gathered` (dropless for a few rows) and, with float
weights, `hidden_axes` (sharded experts, tensor parallel). The math of each is written once (`apply`) over the
grouped-linear primitive (`grouped_linear`), which takes float arrays or packed quantized weights.

Every weight is [E, out, in], as the checkpoints store each expert's linear weight. With `weight_format`
(a `pallas_kernels.quant.FORMATS` name) in the experts dict (`{'type': 'swiglu', 'weight_format': 'nvfp4', ...}`) the
same parameters are `pallas_kernels.quant` containers of the same logical shapes (one pytree for float and packed
layers): `grouped` runs the dequantizing grouped matmul (`pallas_kernels.quant_gmm`: the kernel on a GPU, the
float32 XLA reference elsewhere), `batched` and `gathered` dequantize in XLA. `init` quantizes random weights
(tests, benchmarks). Quantized experts are for inference (no VJP) and cannot be sharded (`hidden_axes` is None).
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


def _uniform(key, shape, fan_in, dtype, weight_format=None):
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)) in `dtype`, or quantized to `weight_format` (a packed container)."""
    bound = fan_in ** -0.5
    w = jax.random.uniform(key, shape, jnp.float32, -bound, bound)
    return w.astype(dtype) if weight_format is None else quant.quantize(w, weight_format)


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

    Parameters, float arrays or (`weight_format`) packed containers of the same shapes, the HF per-expert
    `{gate,up,down}_proj.weight` stacked: gate_proj [E, I, M], up_proj [E, I, M], down_proj [E, M_out, I]. The
    hidden axis (I) can be split over devices (float weights).
    """

    hidden_size_per_expert: int
    activation_fn: Callable[[jax.Array], jax.Array] = jax.nn.silu
    output_dim: int | None = None
    kernel_backend: str | None = None  # see `backends.kernels`: None = the compile platform's kernels
    weight_format: str | None = None

    def init(self, key, model_dim, num_experts, dtype):
        hidden, out_dim, fmt = self.hidden_size_per_expert, self.output_dim or model_dim, self.weight_format
        k1, k2, k3 = jax.random.split(key, 3)
        return {"gate_proj": _uniform(k1, (num_experts, hidden, model_dim), model_dim, dtype, fmt),
                "up_proj": _uniform(k2, (num_experts, hidden, model_dim), model_dim, dtype, fmt),
                "down_proj": _uniform(k3, (num_experts, out_dim, hidden), hidden, dtype, fmt)}

    def apply(self, params, x, mode: Mode):
        """The math, once: `down(act(gate(x)) * up(x))`."""
        h = self.activation_fn(mode.linear(x, params["gate_proj"])) * mode.linear(x, params["up_proj"])
        return mode.linear(h, params["down_proj"])

    def native_unsupported(self):
        return None if self.activation_fn is jax.nn.silu else f"the activation {self.activation_fn} (silu only)"

    def native(self, params, x, expert_ids, enc, dec, activations="float32"):
        return moe_experts(x, expert_ids, enc, dec, params["gate_proj"], params["down_proj"], up=params["up_proj"],
                           activations=activations)

    def _hidden_axes(self, params):
        return {"gate_proj": 1, "up_proj": 1, "down_proj": 2}


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

    Parameters ([out, in]; float arrays or, with `weight_format`, packed containers of the same shapes, the
    biases float either way): gate_up_proj [E, 2I, M] (gate / up interleaved on the out axis), gate_up_proj_bias
    [E, 2I], down_proj [E, M_out, I], down_proj_bias [E, M_out]. A float HF checkpoint stores the two weights
    [E, in, out]; the loader transposes them (`models.hf_moe_block`).
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
        gate_up = _uniform(k1, (num_experts, 2 * hidden, model_dim), model_dim, dtype, fmt)
        down = _uniform(k3, (num_experts, out_dim, hidden), hidden, dtype, fmt)
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
        # interleaved gate/up: each contiguous block of 2I/r output rows holds whole (gate, up) pairs
        return {"gate_up_proj": 1, "gate_up_proj_bias": 1, "down_proj": 2, "down_proj_bias": None}


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
