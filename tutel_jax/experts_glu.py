"""Gated-linear-unit experts of today's open MoE models: fused SwiGLU and GPT-OSS's clamped SwiGLU with biases.

Registered as expert types 'swiglu' and 'gpt_oss' (see `experts.EXPERT_TYPES`); both have `batched` (capacity
buffer), `grouped` (dropless, rows sorted by expert) and `hidden_axes` (sharded experts, tensor parallel).
With `weight_format` ('fp8_block', 'mxfp4', 'nvfp4') the weights stay quantized (`experts_quant`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from .dispatch import group_row_experts
from .experts import _activation, _grouped_matmul, register_experts
from .experts_quant import QuantGptOssExperts, QuantSwiGLUExperts
from .quant_weights import check_format

__all__ = ["SwiGLUExperts", "GptOssExperts", "gpt_oss_glu"]


def _uniform(key, shape, fan_in, dtype):
    bound = fan_in ** -0.5
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)


@dataclasses.dataclass(frozen=True)
class SwiGLUExperts:
    """SwiGLU experts with one fused gate/up matmul: `(act(x @ W_gate) * (x @ W_up)) @ W_down`, act = silu.

    Parameters:
      gate_up_proj [E, M, 2, I]: one matmul against its [M, 2I] view, whose first I columns are the gate and the
        last I the up projection (HF per-expert `gate_proj.weight.T` and `up_proj.weight.T` stacked on axis 1);
        the hidden axis (3) can be split over devices.
      down_proj [E, I, M_out] (HF `down_proj.weight.T`).
    """

    hidden_size_per_expert: int
    activation_fn: Callable[[jax.Array], jax.Array] = jax.nn.silu
    output_dim: int | None = None
    kernel_backend: str | None = None  # grouped(): None = lax.ragged_dot, else pallas_kernels.gmm implementation

    def init(self, key, model_dim, num_experts, dtype):
        hidden, out_dim = self.hidden_size_per_expert, self.output_dim or model_dim
        k1, k2 = jax.random.split(key)
        return {"gate_up_proj": _uniform(k1, (num_experts, model_dim, 2, hidden), model_dim, dtype),
                "down_proj": _uniform(k2, (num_experts, hidden, out_dim), hidden, dtype)}

    def _glu(self, h):
        gate, up = jnp.split(h, 2, axis=-1)
        return self.activation_fn(gate) * up

    def batched(self, params, x):
        w = params["gate_up_proj"]
        num_experts, model_dim = w.shape[:2]
        h = jnp.einsum("ecm,emn->ecn", x, w.reshape(num_experts, model_dim, -1).astype(x.dtype))
        return jnp.einsum("eci,eio->eco", self._glu(h), params["down_proj"].astype(x.dtype))

    def grouped(self, params, x, group_sizes):
        w = params["gate_up_proj"]
        h = _grouped_matmul(x, w.reshape(w.shape[0], w.shape[1], -1), group_sizes, self.kernel_backend)
        return _grouped_matmul(self._glu(h), params["down_proj"], group_sizes, self.kernel_backend)

    def gathered(self, params, x, expert_ids):
        """x [R, M], expert_ids [R] -> [R, M_out]: row r through expert expert_ids[r] (weights gathered per row)."""
        w = params["gate_up_proj"][expert_ids]  # [R, M, 2, I]
        h = jnp.einsum("rm,rmn->rn", x, w.reshape(w.shape[0], w.shape[1], -1).astype(x.dtype))
        return jnp.einsum("ri,rio->ro", self._glu(h), params["down_proj"][expert_ids].astype(x.dtype))

    def hidden_axes(self, params):
        return {"gate_up_proj": 3, "down_proj": 1}


def gpt_oss_glu(h: jax.Array, alpha: float = 1.702, limit: float = 7.0) -> jax.Array:
    """GPT-OSS's clamped SwiGLU on interleaved pre-activations h [..., 2I] (gate = even, up = odd columns):
    `gate = min(gate, limit)`, `up = clip(up, -limit, limit)`, `(up + 1) * gate * sigmoid(alpha * gate)`."""
    gate, up = h[..., ::2], h[..., 1::2]
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


@dataclasses.dataclass(frozen=True)
class GptOssExperts:
    """GPT-OSS experts: `gpt_oss_glu(x @ gate_up_proj + gate_up_proj_bias) @ down_proj + down_proj_bias`.

    Parameters, in the checkpoint's own layout ([in, out], gate/up interleaved):
      gate_up_proj [E, M, 2I], gate_up_proj_bias [E, 2I], down_proj [E, I, M_out], down_proj_bias [E, M_out].
    Attributes: swiglu_alpha (1.702), swiglu_limit (7.0; the config's `swiglu_limit`).
    """

    hidden_size_per_expert: int
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    output_dim: int | None = None
    kernel_backend: str | None = None  # grouped(): None = lax.ragged_dot, else pallas_kernels.gmm implementation

    def init(self, key, model_dim, num_experts, dtype):
        hidden, out_dim = self.hidden_size_per_expert, self.output_dim or model_dim
        k1, k2, k3, k4 = jax.random.split(key, 4)
        return {"gate_up_proj": _uniform(k1, (num_experts, model_dim, 2 * hidden), model_dim, dtype),
                "gate_up_proj_bias": _uniform(k2, (num_experts, 2 * hidden), model_dim, dtype),
                "down_proj": _uniform(k3, (num_experts, hidden, out_dim), hidden, dtype),
                "down_proj_bias": _uniform(k4, (num_experts, out_dim), hidden, dtype)}

    def _glu(self, h):
        return gpt_oss_glu(h, self.swiglu_alpha, self.swiglu_limit)

    def batched(self, params, x):
        dtype = x.dtype
        h = jnp.einsum("ecm,emn->ecn", x, params["gate_up_proj"].astype(dtype))
        h = h + params["gate_up_proj_bias"][:, None, :].astype(dtype)
        y = jnp.einsum("eci,eio->eco", self._glu(h), params["down_proj"].astype(dtype))
        return y + params["down_proj_bias"][:, None, :].astype(dtype)

    def grouped(self, params, x, group_sizes):
        rows = group_row_experts(group_sizes, x.shape[0])
        h = _grouped_matmul(x, params["gate_up_proj"], group_sizes, self.kernel_backend)
        h = h + params["gate_up_proj_bias"].astype(h.dtype)[rows]
        y = _grouped_matmul(self._glu(h), params["down_proj"], group_sizes, self.kernel_backend)
        return y + params["down_proj_bias"].astype(y.dtype)[rows]

    def gathered(self, params, x, expert_ids):
        """x [R, M], expert_ids [R] -> [R, M_out]: row r through expert expert_ids[r] (weights gathered per row)."""
        dtype = x.dtype
        h = jnp.einsum("rm,rmn->rn", x, params["gate_up_proj"][expert_ids].astype(dtype))
        h = h + params["gate_up_proj_bias"][expert_ids].astype(dtype)
        y = jnp.einsum("ri,rio->ro", self._glu(h), params["down_proj"][expert_ids].astype(dtype))
        return y + params["down_proj_bias"][expert_ids].astype(dtype)

    def hidden_axes(self, params):
        # interleaved gate/up: each contiguous block of 2I/r columns holds whole (gate, up) pairs
        return {"gate_up_proj": 2, "gate_up_proj_bias": 1, "down_proj": 1, "down_proj_bias": None}


def _swiglu_factory(hidden_size_per_expert, activation_fn=None, output_dim=None, kernel_backend=None,
                    weight_format=None):
    act = _activation(activation_fn, "silu")
    if check_format(weight_format, "experts['weight_format']") is not None:
        return QuantSwiGLUExperts(hidden_size_per_expert, weight_format, act, output_dim, kernel_backend)
    return SwiGLUExperts(hidden_size_per_expert, act, output_dim, kernel_backend)


def _gpt_oss_factory(hidden_size_per_expert, swiglu_limit=7.0, swiglu_alpha=1.702, output_dim=None,
                     kernel_backend=None, weight_format=None):
    for name, value in (("swiglu_limit", swiglu_limit), ("swiglu_alpha", swiglu_alpha)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"experts['{name}'] must be a positive number, got {value!r}")
    if check_format(weight_format, "experts['weight_format']") is not None:
        return QuantGptOssExperts(hidden_size_per_expert, weight_format, float(swiglu_alpha), float(swiglu_limit),
                                  output_dim, kernel_backend)
    return GptOssExperts(hidden_size_per_expert, float(swiglu_alpha), float(swiglu_limit), output_dim, kernel_backend)


register_experts("swiglu", _swiglu_factory)
register_experts("gpt_oss", _gpt_oss_factory)
