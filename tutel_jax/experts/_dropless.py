"""Dropless expert computation (capacity_factor == 0): ragged (no padding) or bucketed (bounded padding).

'ragged': permute the k*S assignments into rows sorted by expert, run `experts.grouped` (`lax.ragged_dot`), and
  unpermute; each direction has a custom VJP (see `dispatch`). No [E, C, M] buffer and no padding. On XLA:CPU
  `ragged_dot` is dense-masked (every row is multiplied by every expert's weights, then masked), so it costs E times
  the useful work: ~10x (E = 8) to ~50x (E = 256) slower than a batched matmul.

'bucketed': the capacity path at a static capacity chosen at run time from a short ladder,
  `bucket_capacities(S, E, k)` = ceil(k*S/E) x (1, 1.25, 1.5, 2, 3, 4) (deduplicated, at most S): `lax.switch`
  picks the smallest bucket >= the largest per-expert count, so nothing is dropped and the outputs equal the ragged
  path's. Padding is at most 25% over the max count up to 2x balance, then at most 50%. When the max count exceeds
  the top bucket (4x the balanced load) the call falls back to the ragged path, so memory stays bounded by
  4 x k*S*M rows whatever the routing. Every branch is compiled (about len(buckets) x the expert compile time).
  On CPU, while an [E, S, M] buffer is small the ladder continues to S instead of falling back
  (`extend_for_cpu`: the short prompt whose tokens crowd onto a few experts).

'loop': the ragged path with the grouped matmul as a loop over the used experts in small row chunks
  (`expert_loop.grouped`): idle experts cost nothing and each used expert's weights are read once. The CPU
  decode path: a decode step is bound by reading the chosen experts' weights.

'gather': each of the k*S assignments runs through its own expert's weights, gathered per row
  (`experts.gathered`).

'native': on CPU, the whole routed-experts step in one native call (`tutel_jax.native.moe_experts`, C++
  through XLA FFI, compiled on first use): the used experts' weights stream once, in memory order, over all
  cores, packed ones (FP8 block, MXFP4, NVFP4, per channel) decoded in registers. SwiGLU (silu) and GPT-OSS
  experts, float32, bfloat16 or packed weights; computes in float32; gradients through the 'loop' path. The
  fastest CPU decode path (XLA:CPU copies every expert chosen at run time before its matmul, and dequantizes packed
  ones).

'native_int8': 'native' with the activations of MXFP4 / NVFP4 experts that receive a few rows quantized to int8
  per block of 32 and multiplied in integer dot products (`native.moe_experts(activations='int8')`: llama.cpp's
  Q8_0 activations: about 1e-2 of a layer's output rms); other weights as 'native'.

`MoEConfig.dropless_impl` chooses: 'ragged' (the default: no padding at all), 'bucketed', 'loop', 'gather',
'native', or
'auto' (on CPU, quantized experts: 'native_int8' for FP4 formats (but with the portable C++ build) and 'native'
for FP8 where the kernel can run them, else 'loop'; float experts: 'loop' when
k*S <= 32E, else 'bucketed' for experts that have `grouped`, needed by the fallback;
'ragged' on other backends). Expert parallelism
always uses buckets for its padded all_to_all (see `parallel.expert_parallel`), topped by S_local.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from .. import core
from ..native import NativeKernelError, isa_in_effect, ensure_registered, int8_by_default
from ..routing import RoutingPlan, align_capacity
from ..validation import check_choice, check_int

__all__ = ["BUCKET_FACTORS", "DROPLESS_PATHS", "DroplessPath", "bucket_capacities", "bucket_index", "check_native", "native_available",
           "extend_for_cpu", "register_dropless_path", "resolve_impl", "run_bucketed"]

BUCKET_FACTORS: tuple[float, ...] = (1.0, 1.25, 1.5, 2.0, 3.0, 4.0)


def bucket_capacities(num_tokens: int, num_experts: int, top_k: int, factors: Sequence[float] = BUCKET_FACTORS,
                      alignment: int = 1, max_capacity: int | None = None) -> tuple[int, ...]:
    """The static capacities of the bucketed dropless path, ascending.

    Args:
      num_tokens: S (tokens on this device).
      num_experts: E.
      top_k: k.
      factors: multiples of the balanced load ceil(k*S/E).
      alignment: each capacity is rounded up to a multiple of this.
      max_capacity: upper bound (default S aligned: no expert can receive more than S assignments, since a
        token's k experts are distinct).
    """
    for value, name in ((num_tokens, "num_tokens"), (num_experts, "num_experts"), (top_k, "top_k")):
        check_int(value, name, minimum=1)
    top = align_capacity(num_tokens, alignment) if max_capacity is None else int(max_capacity)
    base = math.ceil(top_k * num_tokens / num_experts)
    caps = {min(align_capacity(max(1, math.ceil(base * f)), alignment), top) for f in factors}
    return tuple(sorted(caps))


def bucket_index(max_count: jax.Array, capacities: Sequence[int]) -> jax.Array:
    """[] int32: index of the smallest capacity >= max_count, or len(capacities) when none is."""
    caps = jnp.asarray(capacities, jnp.int32)
    return jnp.sum((caps < max_count).astype(jnp.int32))


def run_bucketed(plan: RoutingPlan, capacities: Sequence[int], run_at: Callable[[RoutingPlan], Any],
                 overflow: Callable[[], Any] | None = None, need: jax.Array | None = None) -> Any:
    """Runs `run_at(plan laid out with capacity C)` for the smallest C in `capacities` holding every assignment.

    Args:
      plan: a dropless plan (its `dispatch_count` decides the bucket; for expert parallelism pass a plan whose
        counts are already reduced over the group, or reduce inside `run_at`).
      capacities: ascending static capacities.
      run_at: function of a plan with `buffer_capacity` set; all branches must return the same shapes.
      overflow: run when the max count exceeds the largest capacity; None means it cannot (the caller
        guarantees capacities[-1] >= any count).
      need: the slots needed (default: max of plan.dispatch_count); expert parallelism passes the capacity
        agreed over the group, so that every device takes the same branch (its collectives must match).
    """
    need = jnp.max(plan.dispatch_count) if need is None else need
    # Each branch is rematerialised (jax.checkpoint): differentiating a switch otherwise makes every branch
    # output the union of all branches' residuals, zero-filled, which cost 4-10x the backward pass in
    # benchmarks/dropless.py; with remat the residuals are the shared inputs and the chosen branch recomputes
    # its forward pass in the backward one.
    branches = [(lambda cap: (lambda: run_at(plan.with_buffer_capacity(cap))))(c) for c in capacities]
    if overflow is not None:
        branches.append(overflow)
    if len(branches) == 1:
        return branches[0]()
    branches = [jax.checkpoint(b) for b in branches]
    index = jnp.minimum(bucket_index(need, capacities), len(branches) - 1)
    return jax.lax.switch(index, branches)


IMPLS = ("auto", "ragged", "bucketed", "gather", "loop", "native", "native_int8")  # 'auto' and the built-in paths


@dataclasses.dataclass(frozen=True)
class DroplessPath:
    """One way to run the routed experts of a dropless plan.

    Attributes:
      name: the `dropless_impl` value that selects it.
      run: `run(expert_params, x [S, M], plan, config, spread) -> [S, M_out]`; spread: the experts the k*S
        assignments spread over (E; a device-local plan over n of E experts passes E).
      requires: the optional experts method it calls (`experts.OPTIONAL_METHODS`, e.g. 'gathered'), or None.
      check: `check(experts)` raising ValueError when the path cannot run them here, or None.
    """
    name: str
    run: Callable[..., Any]
    requires: str | None = None
    check: Callable[[Any], None] | None = None


#: the dropless paths by name (the built-in ones are registered by `tutel_jax.layer._expert_paths`)
DROPLESS_PATHS: dict[str, DroplessPath] = {}


def register_dropless_path(path: DroplessPath) -> None:
    """Adds (or replaces) a dropless path, selected by `dropless_impl=path.name`."""
    DROPLESS_PATHS[path.name] = path


def impl_names() -> tuple[str, ...]:
    """The valid `dropless_impl` values: 'auto' and every registered path."""
    return ("auto", *DROPLESS_PATHS) if DROPLESS_PATHS else IMPLS


#: on CPU the bucket ladder reaches S (no ragged fallback) while the [E, S, M] buffer stays below this
CPU_FULL_BUFFER_BYTES = 64 * 2**20


def extend_for_cpu(capacities: Sequence[int], num_tokens: int, num_experts: int, row_bytes: int) -> tuple[int, ...]:
    """On CPU, where ragged_dot is dense-masked, the ladder continues (2x its top, then S) instead of falling back
    to the ragged path, when an [E, S, M] buffer of `row_bytes`-byte rows is at most CPU_FULL_BUFFER_BYTES
    (e.g. the prefill of a short prompt whose tokens crowd onto a few experts)."""
    caps = tuple(capacities)
    if (core.platform() != "cpu" or caps[-1] >= num_tokens
            or num_experts * num_tokens * row_bytes > CPU_FULL_BUFFER_BYTES):
        return caps
    return caps + tuple(sorted({min(2 * caps[-1], num_tokens), num_tokens}))


#: on CPU 'auto' loops over the used experts ('loop') while k*S is at most this many times E: decode and short
#: prefills, where padding every expert to a bucket costs more than one matmul per chunk (beyond it, and for the
#: backward pass of big batches, the batched matmul of 'bucketed' is faster)
CPU_LOOP_MAX_ROWS_PER_EXPERT = 32


def resolve_impl(impl: str, experts: Any, num_assignments: int | None = None, num_experts: int | None = None) -> str:
    """'auto' on CPU: for quantized experts (`weight_format`) 'native_int8' (FP4) or 'native' (FP8) where the C++
    kernel can run them (packed weights decoded in registers, each used expert's bytes read once), else 'loop'
    (each expert dequantized on its own, never a whole layer at once), whatever the batch; for float experts
    'loop' when the k*S assignments are at most CPU_LOOP_MAX_ROWS_PER_EXPERT x E (decode: each used expert's
    weights read once, idle experts skipped), else 'bucketed' when the experts have `grouped` (for the overflow
    fallback); 'ragged' on other core."""
    if impl == "auto":
        if core.platform() != "cpu":
            return "ragged"
        weight_format = getattr(experts, "weight_format", None)
        if weight_format is not None and experts.supports("grouped"):
            if not native_available(experts):
                return "loop"
            return "native_int8" if int8_by_default(weight_format) else "native"
        if (num_assignments is not None and num_experts is not None
                and num_assignments <= CPU_LOOP_MAX_ROWS_PER_EXPERT * num_experts):
            return "loop"
        return "bucketed" if experts.supports("grouped") else "ragged"
    path = DROPLESS_PATHS[check_choice(impl, "dropless_impl", impl_names())]
    if path.requires is not None and not experts.supports(path.requires):
        raise ValueError(f"dropless_impl={impl!r} needs experts with a {path.requires}() method; "
                         f"{experts.type_name} has none")
    if path.check is not None:
        path.check(experts)
    return impl


def check_native(experts: Any) -> None:
    """Raises ValueError unless dropless_impl='native' can run `experts` here (CPU, experts with a `native`
    method: SwiGLU with silu or GPT-OSS, float or packed), and `native.NativeKernelError` when the kernel cannot
    be built (it is compiled here on first use)."""
    if core.platform() != "cpu":
        raise ValueError(f"dropless_impl='native' is a CPU kernel; this program is compiled for "
                         f"{core.platform()!r}")
    if not experts.supports("native"):
        raise ValueError(f"dropless_impl='native' runs SwiGLU (silu) or GPT-OSS experts, float or packed; got "
                         f"{experts.type_name}")
    reason = experts.native_unsupported()
    if reason is not None:
        raise ValueError(f"dropless_impl='native' cannot run {experts.type_name} with {reason}")
    ensure_registered()


def native_available(experts: Any) -> bool:
    """Whether 'native' can run `experts` here (`check_native` passes, the kernel built). A TUTEL_JAX_NATIVE_ISA that
    this CPU cannot run raises (NativeKernelError): a forced ISA is never silently replaced by another path."""
    isa_in_effect()
    try:
        check_native(experts)
    except (ValueError, NativeKernelError):
        return False
    return True
