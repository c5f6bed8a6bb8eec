"""A CausalLM forward whose compile time does not grow with depth: one compiled program per kind of block.

    fwd = LayerPrograms(spec, moe_configs)          # what `CausalLM.forward_fn` is with per_layer_jit
    logits, cache = fwd(params, ids, ctx, cache)    # embed, one dispatch per block of layers, head

XLA compiles a whole-model forward as one program, whose size (and compile time) grows with the number of
layers. Here the layers run in blocks of consecutive layers (by default whole repeats of the pattern of the
layers' kinds, up to 8 layers: GPT-OSS-20B four pairs of a sliding and a full layer, Qwen3-30B-A3B eight
layers), and blocks of one kind share one program:
what differs between layers is only their weights, their sliding window and their MoE config (None: a dense
MLP), so GPT-OSS compiles one block program, Qwen3-MoE one, whatever the depth. Each block's KV caches are
donated to its program (updated in place); each layer reads its own weight buffers as they are.

Why not `lax.scan` over stacked layers: a scan body reads its layer as a dynamic slice of the stacked weights,
and XLA:CPU materializes that slice (for custom calls and dots alike) -- a copy of every layer's weights at
every step, where a decode step only needs the few experts it routes to (measured ~10x slower with the native
kernels).

Called inside a trace (an outer `jit`, e.g. `generate(on_device=True)` or a training step), it traces `forward`
instead: one program, as without it. `ModelStep` wraps a serving step (sampling around the model): jitted for a
whole-program model, unjitted around the per-layer programs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from ..validation import check_int
from ._decoder import decoder_layer, embed, forward, head
from ._layers import AttnContext
from ._spec import DecoderSpec

__all__ = ["LayerPrograms", "ModelStep", "MAX_LAYERS_PER_PROGRAM"]

#: a block program holds at most this many layers (unless `layers_per_program` says otherwise): fewer dispatches
#: per step than a layer each, compile time still flat with depth
MAX_LAYERS_PER_PROGRAM = 8


def _block(lps, x, cos, sin, ctx, caches, *, spec, kinds, expert_mesh):
    """Consecutive layers (kinds: their (window, moe_config)s) -> (x, their new caches)."""
    new = []
    for lp, cache, (window, moe_config) in zip(lps, caches, kinds):
        x, cache, _ = decoder_layer(lp, x, cos, sin, ctx, cache, spec=spec, window=window, moe_config=moe_config,
                                    expert_mesh=expert_mesh)
        new.append(cache)
    return x, new


# The programs are jitted with their static arguments bound (`partial`), not passed at each call: a decode step
# dispatches one program per block, and hashing a DecoderSpec and MoE configs at every dispatch would cost as
# much as the dispatch itself.
@functools.lru_cache(maxsize=256)
def _block_program(spec: DecoderSpec, kinds: tuple, expert_mesh: Any, donate: bool):
    return jax.jit(functools.partial(_block, spec=spec, kinds=kinds, expert_mesh=expert_mesh),
                   donate_argnames=("caches",) if donate else ())


@functools.lru_cache(maxsize=64)
def _end_programs(spec: DecoderSpec):
    return jax.jit(functools.partial(embed, spec=spec)), jax.jit(functools.partial(head, spec=spec))


@functools.lru_cache(maxsize=64)
def program_table(layer_programs: "LayerPrograms") -> tuple:
    """(embed program, ((first layer, last layer + 1, block program) for each block), head program)."""
    lp = layer_programs
    kinds = tuple(zip(lp.spec.windows, lp.moe_configs))
    size = lp.block_size()
    blocks = tuple((i, min(i + size, len(kinds)), _block_program(lp.spec, kinds[i:i + size], lp.expert_mesh,
                                                                 lp.donate_cache))
                   for i in range(0, len(kinds), size))
    embed_program, head_program = _end_programs(lp.spec)
    return embed_program, blocks, head_program


def _period(kinds: tuple) -> int:
    """The shortest p with kinds[i] == kinds[i % p] for every i (a repeating pattern; else len(kinds))."""
    return next(p for p in range(1, len(kinds) + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds)))


def _tracing(tree: Any) -> bool:
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(tree))


@dataclasses.dataclass(frozen=True)
class LayerPrograms:
    """`forward` (same arguments and results, without return_router / moe_fn) run as embed, one compiled
    program per kind of block of layers (`block_size`), head. Hashable: usable as a static argument like
    `functools.partial(forward)`.
    donate_cache: each layer's cache is donated to its program (updated in place; the caller's cache is then
    invalid, as with a jitted step that donates it)."""

    spec: DecoderSpec
    moe_configs: tuple
    expert_mesh: tuple[Any, str] | None = None
    donate_cache: bool = False
    layers_per_program: int | None = None  # None: see block_size

    def __post_init__(self):
        check_int(self.layers_per_program, "layers_per_program", minimum=1, optional=True)

    def __call__(self, params: dict, input_ids: jax.Array, ctx: AttnContext, cache: list | None = None,
                 logits_at: jax.Array | None = None):
        """(logits float32 [B, T, V] or [B, 1, V] at logits_at, new cache or None); see `forward`."""
        # traced params show in their embedding: the other layers' leaves need not be walked at every step
        if _tracing((params["embed"], input_ids, ctx, cache, logits_at)):
            return forward(params, input_ids, ctx, cache, spec=self.spec, moe_configs=self.moe_configs,
                           expert_mesh=self.expert_mesh, logits_at=logits_at)
        embed_program, blocks, head_program = program_table(self)
        x, cos, sin = embed_program({"embed": params["embed"]}, input_ids, ctx)
        new_cache, layers = [], params["layers"]
        for start, stop, program in blocks:
            x, c = program(layers[start:stop], x, cos, sin, ctx,
                           [None] * (stop - start) if cache is None else cache[start:stop])
            new_cache += c
        top = {k: params[k] for k in ("norm", "lm_head") if k in params}
        if "lm_head" not in top:  # tied
            top["embed"] = params["embed"]
        return head_program(top, x, logits_at=logits_at), None if cache is None else new_cache

    def block_size(self) -> int:
        """Layers per program: `layers_per_program`, or whole repeats of the period of the layers' kinds
        (GPT-OSS: 2, a sliding and a full layer; Qwen3-MoE: 1) up to `MAX_LAYERS_PER_PROGRAM`, preferring a
        size that divides the depth (one program for every block). A step dispatches depth / size programs, and
        each dispatch costs host time that on a CPU takes a core from the step's kernels; a kind with no short
        period takes blocks of MAX_LAYERS_PER_PROGRAM (a program per distinct block)."""
        if self.layers_per_program is not None:
            return self.layers_per_program
        depth = len(self.moe_configs)
        period = _period(tuple(zip(self.spec.windows, self.moe_configs)))
        if period > MAX_LAYERS_PER_PROGRAM:
            return min(depth, MAX_LAYERS_PER_PROGRAM)
        sizes = range(period, MAX_LAYERS_PER_PROGRAM + 1, period)
        dividing = [s for s in sizes if depth % s == 0 and 2 * s >= MAX_LAYERS_PER_PROGRAM]
        return min(depth, dividing[-1] if dividing else sizes[-1])

    def kinds(self) -> int:
        """How many block programs a forward compiles (distinct blocks of layer kinds)."""
        return len({program for _, _, program in program_table(self)[1]})

    def compiled_layer_programs(self) -> int:
        """How many block programs are compiled so far (over all shapes) for this forward."""
        return sum(program._cache_size() for program in {program for _, _, program in program_table(self)[1]})


class ModelStep:
    """A model step `body(apply, ..., cache, ...)` (the model's forward_fn first, its KV cache an argument named
    `cache`), called as `step(apply, *args)`: jitted with the cache donated (one program with the model), or,
    when `apply` is `LayerPrograms`, `body` itself with each layer's cache donated, so the model keeps its
    per-layer programs (the few array operations around it run as they are)."""

    def __init__(self, body: Callable, static_argnames: tuple[str, ...] = ("apply",)):
        self.body = body
        self.jitted = jax.jit(body, static_argnames=static_argnames, donate_argnames=("cache",))

    def __call__(self, apply: Any, *args, **kwargs):
        if isinstance(apply, LayerPrograms):
            return self.body(dataclasses.replace(apply, donate_cache=True), *args, **kwargs)
        return self.jitted(apply, *args, **kwargs)
