"""SwiGLU and GPT-OSS experts whose weights stay quantized (FP8 block, MXFP4, NVFP4) in memory.

Chosen with `weight_format` in the experts dict: `{'type': 'swiglu', 'weight_format': 'nvfp4', ...}` or
`{'type': 'gpt_oss', 'weight_format': 'mxfp4', ...}`. Weights keep the checkpoint's [out, in] layout per
expert as `pallas_kernels.quant` containers; `grouped` (dropless) runs the dequantizing grouped matmul
(`pallas_kernels.quant_gmm`: the kernel on a GPU, the float32 XLA reference elsewhere), `batched` (capacity
buffers) dequantizes in XLA. `init` quantizes random weights (tests, benchmarks). Inference only: no VJP.
Sharded experts (count_per_node < 0) are not supported (no `hidden_axes`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from . import quant_weights as qw
from .dispatch import group_row_experts

__all__ = ["QuantSwiGLUExperts", "QuantGptOssExperts"]


def _random_quantized(key, shape, fan_in, weight_format):
    bound = fan_in ** -0.5
    return qw.quantize(jax.random.uniform(key, shape, jnp.float32, -bound, bound), weight_format)


@dataclasses.dataclass(frozen=True)
class QuantSwiGLUExperts:
    """`down(act(gate(x)) * up(x))` per expert with quantized weights.

    Parameters (containers, HF [out, in] layout): gate_proj [E, I, M], up_proj [E, I, M], down_proj [E, M_out, I].
    """

    hidden_size_per_expert: int
    weight_format: str
    activation_fn: Callable[[jax.Array], jax.Array] = jax.nn.silu
    output_dim: int | None = None
    kernel_backend: str | None = None  # None: "auto" (kernel on a GPU), else a pallas_kernels implementation

    def init(self, key, model_dim, num_experts, dtype):
        hidden, out_dim = self.hidden_size_per_expert, self.output_dim or model_dim
        k1, k2, k3 = jax.random.split(key, 3)
        fmt = self.weight_format
        return {"gate_proj": _random_quantized(k1, (num_experts, hidden, model_dim), model_dim, fmt),
                "up_proj": _random_quantized(k2, (num_experts, hidden, model_dim), model_dim, fmt),
                "down_proj": _random_quantized(k3, (num_experts, out_dim, hidden), hidden, fmt)}

    def batched(self, params, x):
        h = self.activation_fn(qw.batched(x, params["gate_proj"])) * qw.batched(x, params["up_proj"])
        return qw.batched(h, params["down_proj"])

    def gathered(self, params, x, expert_ids):
        """x [R, M], expert_ids [R] -> [R, M_out]: only the R chosen experts' packed weights are dequantized."""
        h = (self.activation_fn(qw.gathered(x, params["gate_proj"], expert_ids))
             * qw.gathered(x, params["up_proj"], expert_ids))
        return qw.gathered(h, params["down_proj"], expert_ids)

    def grouped(self, params, x, group_sizes):
        impl = self.kernel_backend
        h = (self.activation_fn(qw.grouped(x, params["gate_proj"], group_sizes, impl))
             * qw.grouped(x, params["up_proj"], group_sizes, impl))
        return qw.grouped(h, params["down_proj"], group_sizes, impl)


@dataclasses.dataclass(frozen=True)
class QuantGptOssExperts:
    """GPT-OSS experts with quantized weights: `glu(x @ gate_up.T + b1) @ down.T + b2` (glu: `gpt_oss_glu`).

    Parameters: gate_up_proj container [E, 2I, M] (gate/up interleaved on the out axis), gate_up_proj_bias
    [E, 2I], down_proj container [E, M_out, I], down_proj_bias [E, M_out] (float).
    """

    hidden_size_per_expert: int
    weight_format: str
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    output_dim: int | None = None
    kernel_backend: str | None = None

    def init(self, key, model_dim, num_experts, dtype):
        hidden, out_dim = self.hidden_size_per_expert, self.output_dim or model_dim
        k1, k2, k3, k4 = jax.random.split(key, 4)
        fmt = self.weight_format
        bias = lambda k, shape, fan_in: jax.random.uniform(k, shape, jnp.float32, -fan_in ** -0.5,
                                                           fan_in ** -0.5).astype(dtype)
        return {"gate_up_proj": _random_quantized(k1, (num_experts, 2 * hidden, model_dim), model_dim, fmt),
                "gate_up_proj_bias": bias(k2, (num_experts, 2 * hidden), model_dim),
                "down_proj": _random_quantized(k3, (num_experts, out_dim, hidden), hidden, fmt),
                "down_proj_bias": bias(k4, (num_experts, out_dim), hidden)}

    def _glu(self, h):
        from .experts_glu import gpt_oss_glu
        return gpt_oss_glu(h, self.swiglu_alpha, self.swiglu_limit)

    def batched(self, params, x):
        h = qw.batched(x, params["gate_up_proj"]) + params["gate_up_proj_bias"][:, None, :].astype(x.dtype)
        y = qw.batched(self._glu(h), params["down_proj"])
        return y + params["down_proj_bias"][:, None, :].astype(x.dtype)

    def gathered(self, params, x, expert_ids):
        h = qw.gathered(x, params["gate_up_proj"], expert_ids)
        h = h + params["gate_up_proj_bias"][expert_ids].astype(x.dtype)
        y = qw.gathered(self._glu(h), params["down_proj"], expert_ids)
        return y + params["down_proj_bias"][expert_ids].astype(x.dtype)

    def grouped(self, params, x, group_sizes):
        rows = group_row_experts(group_sizes, x.shape[0])
        h = qw.grouped(x, params["gate_up_proj"], group_sizes, self.kernel_backend)
        h = h + params["gate_up_proj_bias"].astype(h.dtype)[rows]
        y = qw.grouped(self._glu(h), params["down_proj"], group_sizes, self.kernel_backend)
        return y + params["down_proj_bias"].astype(y.dtype)[rows]
