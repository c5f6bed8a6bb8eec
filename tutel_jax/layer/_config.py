"""`MoEConfig`: Tutel's `moe_layer` arguments, validated once and frozen (hashable, so usable as a jit static)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import jax.numpy as jnp

from ..experts import impl_names, resolve_impl, Experts, as_experts, make_experts, SharedExperts, make_shared_experts
from ._execution import check_kernel_backend
from ..routing import Gate, make_gate
from ..validation import check_choice, check_int

__all__ = ["MoEConfig", "make_config"]


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Static description of one MoE layer.

    Attributes:
      model_dim: M, the channel count of the input [..., M].
      gates: one or more gates; a call picks one with `gate_index`.
      experts: the expert network.
      num_local_experts: experts per device (`count_per_node`); negative -s shares one expert over s devices.
      num_global_experts: E.
      is_postscore: apply gate weights at decode (True) or encode (False).
      batch_prioritized_routing: place tokens by descending best score instead of token order.
      normalize_gate: renormalise the k weights of each token (k > 1).
      is_gshard_loss: GShard loss (True) or importance+load loss (False).
      a2a_ffn_overlap_degree: chunks of the capacity axis for all_to_all / expert overlap.
      parallel_type: Tutel's 'adaptive:r', 'data' or 'model'.
      use_2dh: hierarchical all_to_all.
      dtype: parameter and compute dtype of the experts (the input is cast to it, as in Tutel).
      result_func: optional function applied to the output (Tutel's `result_func`).
      shared_experts: optional dense shared experts added to every token's output (`experts['shared']`).
      dropless_impl: how capacity_factor == 0 runs on one device: 'ragged' (the default: sort +
        `lax.ragged_dot`, no padding at all), 'bucketed' (the capacity path at the smallest of a few static
        capacities >= the max count: bounded padding, much faster on CPU, where ragged_dot is dense-masked),
        'loop' (a loop over the used experts in small row chunks: idle experts are skipped and each used expert's
        weights are read once; the CPU decode path), 'gather' (each assignment through its own expert's
        gathered weights), 'native' (CPU, SwiGLU experts: one C++ kernel per layer streaming the used experts'
        weights over all cores; the fastest CPU decode), or 'auto' (on CPU loop when k*S <= 32E, else
        bucketed; ragged elsewhere). See `tutel_jax.experts._dropless`.
      kernel_backend: the kernels of gating, dispatch/combine and, when the experts take it, their grouped
        matmuls: None / 'auto' (the default: the kernels of the platform the program is compiled for, plain XLA
        on CPUs), 'xla', 'pallas', 'interpret', 'tpu' or 'tpu_interpret' (see `tutel_jax.layer._execution`).
    """

    model_dim: int
    gates: tuple[Gate, ...]
    experts: Experts
    num_local_experts: int = 1
    num_global_experts: int = 1
    is_postscore: bool = True
    batch_prioritized_routing: bool = False
    normalize_gate: bool = True
    is_gshard_loss: bool = True
    a2a_ffn_overlap_degree: int = 1
    parallel_type: str = "adaptive:1"
    use_2dh: bool = False
    dtype: Any = jnp.float32
    result_func: Callable | None = None
    shared_experts: SharedExperts | None = None
    dropless_impl: str = "ragged"
    kernel_backend: str | None = None

    @property
    def sharded_count(self) -> int:
        """Devices sharing one expert (Tutel's `sharded_count`): s for count_per_node = -s, else 1."""
        return -self.num_local_experts if self.num_local_experts < 0 else 1

    def adaptive_degree(self, adaptive_r: int | None = None) -> int:
        """Tutel's r: 0 = data parallel (weights gathered, no all_to_all), s = tensor parallel over the hidden
        dim, 1 <= r | s in between; from `adaptive_r` or `parallel_type`. Checked against {0} u divisors(s)."""
        s = self.sharded_count
        if adaptive_r is None:
            if self.parallel_type == "data":
                adaptive_r = 0
            elif self.parallel_type == "model":
                adaptive_r = s
            else:
                adaptive_r = int(self.parallel_type.split(":", 1)[1])
        valid = valid_adaptive_degrees(s)
        if isinstance(adaptive_r, bool) or not isinstance(adaptive_r, int) or adaptive_r not in valid:
            raise ValueError(f"adaptive_r must be one of {valid} (0 or a divisor of the sharded count {s}), "
                             f"got {adaptive_r!r}")
        return adaptive_r

    @property
    def output_dim(self) -> int:
        return self.experts.output_dim or self.model_dim

    def gate(self, gate_index: int) -> Gate:
        check_int(gate_index, "gate_index", minimum=0, maximum=len(self.gates) - 1)
        return self.gates[gate_index]


def valid_adaptive_degrees(sharded_count: int) -> list[int]:
    """{0} u divisors(s): the values of Tutel's adaptive r for experts shared by s devices."""
    return [0] + [r for r in range(1, sharded_count + 1) if sharded_count % r == 0]


def _positive_int(name: str, value: Any) -> int:
    check_int(value, name, minimum=1)
    return value


def make_config(
    gate_type: Any,
    model_dim: int,
    experts: Any = None,
    *,
    world_size: int = 1,
    is_postscore: bool = True,
    batch_prioritized_routing: bool = False,
    normalize_gate: bool = True,
    is_gshard_loss: bool = True,
    a2a_ffn_overlap_degree: int = 1,
    parallel_type: str = "adaptive:1",
    use_2dh: bool = False,
    dtype: Any = jnp.float32,
    result_func: Callable | None = None,
    dropless_impl: str = "ragged",
    kernel_backend: str | None = None,
) -> MoEConfig:
    """Validates Tutel's `moe_layer` arguments into an MoEConfig.

    `experts` is Tutel's dict (`type`, `count_per_node` or `num_experts_per_device`, `hidden_size_per_expert`,
    `activation_fn`, ...) or an `experts.Experts` (then one local expert unless its `num_local_experts` says
    otherwise); an object with only `init` and `batched` (and any of the other members) is wrapped in
    `experts.AdaptedExperts`. `world_size` is the size of the expert-parallel group.
    The dict may hold `'shared': {'hidden_size': I, 'gate': bool}` for dense shared experts (see `shared_experts`).
    """
    model_dim = _positive_int("model_dim", model_dim)
    world_size = _positive_int("world_size", world_size)
    if experts is None:
        raise ValueError("experts must be given: a dict such as {'type': 'ffn', 'count_per_node': 2, "
                         "'hidden_size_per_expert': 1024} or an object with init() and batched()")
    shared = None
    if isinstance(experts, Mapping):
        spec = dict(experts)
        if spec.get("shared") is not None:
            shared = make_shared_experts(spec["shared"])
        spec.pop("shared", None)
        if "count_per_node" in spec and "num_experts_per_device" in spec:
            raise ValueError("experts: give only one of 'count_per_node' and 'num_experts_per_device'")
        local = spec.get("count_per_node", spec.get("num_experts_per_device", 1))
        expert_net = make_experts(spec)
    else:
        expert_net = as_experts(experts)  # an object of the minimal protocol (init + batched) is wrapped
        local = expert_net.num_local_experts
    if isinstance(local, bool) or not isinstance(local, int) or local == 0:
        raise ValueError(f"experts['count_per_node'] must be a non-zero integer (n > 0 experts per device, or -s "
                         f"to share one expert over s devices), got {local!r}")
    if local > 0:
        num_global = local * world_size
    else:
        if world_size % (-local) != 0:
            raise ValueError(f"experts['count_per_node'] = {local} shares each expert over {-local} devices, which must "
                             f"divide the expert-parallel world size {world_size}")
        num_global = world_size // (-local)
    hidden = expert_net.hidden_size_per_expert
    if hidden is not None and local < 0 and hidden % (-local) != 0:
        raise ValueError(f"experts['hidden_size_per_expert'] = {hidden} must be divisible by the sharded count {-local}")

    specs = gate_type if isinstance(gate_type, (list, tuple)) else [gate_type]
    if not specs:
        raise ValueError("gate_type must not be empty")
    gates = tuple(make_gate(spec, i) for i, spec in enumerate(specs))
    degree = _positive_int("a2a_ffn_overlap_degree", a2a_ffn_overlap_degree)
    if not isinstance(parallel_type, str) or not (parallel_type in ("data", "model") or (
            parallel_type.startswith("adaptive:") and parallel_type[9:].isdigit())):
        raise ValueError(f"parallel_type must be 'adaptive:<r>', 'data' or 'model', got {parallel_type!r}")
    kernel_backend = check_kernel_backend(kernel_backend)
    if kernel_backend is not None and expert_net.kernel_backend is None:
        expert_net = expert_net.with_kernel_backend(kernel_backend)  # grouped matmuls too
    check_choice(dropless_impl, "dropless_impl", impl_names())
    if dropless_impl != "auto":  # fails here, not at the first call: what the path needs of the experts,
        resolve_impl(dropless_impl, expert_net)  # and for 'native' the backend and the build
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype must be a JAX dtype such as 'float32' or 'bfloat16', got {dtype!r}") from None
    config = MoEConfig(
        model_dim=model_dim, gates=gates, experts=expert_net, num_local_experts=local, num_global_experts=num_global,
        is_postscore=bool(is_postscore), batch_prioritized_routing=bool(batch_prioritized_routing),
        normalize_gate=bool(normalize_gate), is_gshard_loss=bool(is_gshard_loss), a2a_ffn_overlap_degree=degree,
        parallel_type=parallel_type, use_2dh=bool(use_2dh), dtype=dtype, result_func=result_func,
        shared_experts=shared, dropless_impl=dropless_impl, kernel_backend=kernel_backend,
    )
    config.adaptive_degree()  # validates r of 'adaptive:r' against the sharded count
    return config
