"""A CausalLM forward whose compile time does not grow with depth: one compiled program per kind of layer.

    fwd = LayerPrograms(spec, moe_configs)          # what `CausalLM.forward_fn` is with per_layer_jit
    logits, cache = fwd(params, ids, ctx, cache)    # embed, one dispatch per layer, head

XLA compiles a whole-model forward as one program, whose size (and compile time) grows with the number of
layers. Here the layers of one *kind* share one program: what differs between layers is only their weights,
their sliding window and their MoE config (None: a dense MLP), so GPT-OSS compiles two layer programs
(sliding, full), Qwen3-MoE one, whatever the depth. Each layer's KV cache is donated to its program (updated in
place); each layer reads its own weight buffers as they are.

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
from collections.abc import Callable
from typing import Any

import jax

from .causal_lm import decoder_layer, embed, forward, head
from .layers import AttnContext
from .spec import DecoderSpec

__all__ = ["LayerPrograms", "ModelStep"]


def _layer(lp, x, cos, sin, ctx, cache, *, spec, window, moe_config, expert_mesh):
    return decoder_layer(lp, x, cos, sin, ctx, cache, spec=spec, window=window, moe_config=moe_config,
                         expert_mesh=expert_mesh)[:2]


_embed_program = jax.jit(embed, static_argnames=("spec",))
_LAYER_STATIC = ("spec", "window", "moe_config", "expert_mesh")
_layer_program = jax.jit(_layer, static_argnames=_LAYER_STATIC)
_layer_program_donating = jax.jit(_layer, static_argnames=_LAYER_STATIC, donate_argnames=("cache",))
_head_program = jax.jit(head, static_argnames=("spec",))


def _tracing(tree: Any) -> bool:
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(tree))


@dataclasses.dataclass(frozen=True)
class LayerPrograms:
    """`forward` (same arguments and results, without return_router / moe_fn) run as embed, one compiled
    program per kind of layer, head. Hashable: usable as a static argument like `functools.partial(forward)`.
    donate_cache: each layer's cache is donated to its program (updated in place; the caller's cache is then
    invalid, as with a jitted step that donates it)."""

    spec: DecoderSpec
    moe_configs: tuple
    expert_mesh: tuple[Any, str] | None = None
    donate_cache: bool = False

    def __call__(self, params: dict, input_ids: jax.Array, ctx: AttnContext, cache: list | None = None,
                 logits_at: jax.Array | None = None):
        """(logits float32 [B, T, V] or [B, 1, V] at logits_at, new cache or None); see `forward`."""
        # traced params show in their embedding: the other layers' leaves need not be walked at every step
        if _tracing((params["embed"], input_ids, ctx, cache, logits_at)):
            return forward(params, input_ids, ctx, cache, spec=self.spec, moe_configs=self.moe_configs,
                           expert_mesh=self.expert_mesh, logits_at=logits_at)
        x, cos, sin = _embed_program({"embed": params["embed"]}, input_ids, ctx, spec=self.spec)
        new_cache, program = [], _layer_program_donating if self.donate_cache else _layer_program
        for i, lp in enumerate(params["layers"]):
            x, c = program(lp, x, cos, sin, ctx, None if cache is None else cache[i], spec=self.spec,
                           window=self.spec.windows[i], moe_config=self.moe_configs[i], expert_mesh=self.expert_mesh)
            new_cache.append(c)
        top = {k: params[k] for k in ("norm", "lm_head") if k in params}
        if "lm_head" not in top:  # tied
            top["embed"] = params["embed"]
        return _head_program(top, x, spec=self.spec, logits_at=logits_at), None if cache is None else new_cache

    def kinds(self) -> int:
        """How many layer programs a forward compiles (distinct (window, moe_config) pairs)."""
        return len({(w, c) for w, c in zip(self.spec.windows, self.moe_configs)})


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
