"""The programs a model runs, built over abstract weights and lowered for a target mesh, one layer program per
kind of block of layers (`models.layer_programs`) plus embed and head.

    steps = build_steps(model, batch=8, seq=4096, mode="serve")   # [Step('prefill', parts), Step('decode', parts)]
    for part in steps[0].parts: part.fn.lower(*part.args)          # each part: one program, run `count` times

A step's parts run one after the other (embed, each block of layers, head), so a step costs the sum of its
parts times their counts, and its memory peak is the resident state plus the largest part's transient memory.
- prefill: B prompts of S tokens into a KV cache of S slots (the serving prefill: logits at the last token);
- decode: one new token per row against a KV cache of S slots (the serving decode step);
- train: the forward keeps each block's input, then per part (head first) the part's forward is recomputed,
  differentiated and its weights updated with optax AdamW (the cotangent of the part's output comes in, the
  input's goes out; block-level rematerialization); the head's part holds the next-token cross-entropy loss.
  Quantized checkpoints train their dequantized float weights (packed weights have no gradient).
Arguments are tagged by what they hold ('weights', 'kv_cache', 'optimizer', 'activations') for the report.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..models import cache_dims, decoder_layer, embed, head, LayerPrograms, program_table, AttnContext
from ._weights import AbstractModel
from ..validation import check_choice

__all__ = ["Part", "Step", "build_steps", "MODES", "LEARNING_RATE"]

MODES = ("serve", "train")
LEARNING_RATE = 1e-4


@dataclasses.dataclass
class Part:
    """One program of a step: `fn` (jitted) lowered with `args` (abstract, with shardings), run `count` times per
    step; `tags[i]` says what args[i] holds; `layers`: the decoder layers one run covers."""

    name: str
    fn: Any
    args: tuple
    tags: tuple[str, ...]
    count: int
    layers: int = 0


@dataclasses.dataclass
class Step:
    """A program of the report (prefill, decode, train): its parts, and the state every device keeps between
    steps beyond the weights (`kv_cache`, `optimizer`: abstract trees, counted once over all layers)."""

    name: str
    parts: list[Part]
    kv_cache: Any = None
    optimizer: Any = None


def _rep(model: AbstractModel, shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
    """A replicated activation (the expert-sliced layout: every device sees all tokens)."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(model.mesh, P()))


def _ctx(model: AbstractModel, batch: int, new: int, slots: int, prefill: bool = False) -> AttnContext:
    """Where `new` tokens sit in a cache of `slots`; a prefill's index is None (its tokens at slots 0 .. new-1 of
    an empty cache, as `serving.prefill_body` passes it: attention reads only those slots)."""
    return AttnContext(_rep(model, (batch, new), jnp.int32), None if prefill else _rep(model, (), jnp.int32),
                       _rep(model, (batch, slots), jnp.bool_))


def _cache(model: AbstractModel, batch: int, slots: int, layers: int) -> list[dict]:
    """`CausalLM.init_cache` abstract: per layer {'k', 'v'} [B, Hkv, L, D] in the model dtype, replicated."""
    heads, dk, dv = cache_dims(model.spec)
    return [{"k": _rep(model, (batch, heads, slots, dk), model.dtype),
             "v": _rep(model, (batch, heads, slots, dv), model.dtype)} for _ in range(layers)]


def _blocks(model: AbstractModel) -> tuple[Any, list[tuple[int, int, Any, int]], Any]:
    """(embed program, [(first layer, last + 1, block program, how many blocks run it)], head program) of the
    model's per-layer forward with donated caches, as serving runs it."""
    lp = LayerPrograms(model.spec, model.moe_configs, (model.mesh, model.expert_axis), donate_cache=True)
    embed_program, blocks, head_program = program_table(lp)
    kinds: dict[Any, list] = {}
    for start, stop, program in blocks:
        kinds.setdefault(program, [start, stop, program, 0])[3] += 1
    return embed_program, [tuple(k) for k in kinds.values()], head_program


def _top(params: dict) -> dict:
    top = {k: params[k] for k in ("norm", "lm_head") if k in params}
    if "lm_head" not in top:  # tied
        top["embed"] = params["embed"]
    return top


def _serve_step(model: AbstractModel, name: str, batch: int, seq: int) -> Step:
    new = seq if name == "prefill" else 1
    embed_program, blocks, head_program = _blocks(model)
    params, ids = model.params, _rep(model, (batch, new), jnp.int32)
    ctx = _ctx(model, batch, new, seq, prefill=name == "prefill")
    emb = {"embed": params["embed"]}
    x, cos, sin = jax.eval_shape(embed_program, emb, ids, ctx)
    x, cos, sin = (_rep(model, a.shape, a.dtype) for a in (x, cos, sin))
    parts = [Part("embed", embed_program, (emb, ids, ctx), ("weights", "activations", "activations"), 1)]
    for start, stop, program, count in blocks:
        args = (params["layers"][start:stop], x, cos, sin, ctx, _cache(model, batch, seq, stop - start))
        parts.append(Part(f"layers {start}-{stop - 1}" if stop - start > 1 else f"layer {start}", program, args,
                          ("weights",) + ("activations",) * 4 + ("kv_cache",), count, stop - start))
    at = _rep(model, (batch,), jnp.int32) if name == "prefill" else None
    head_fn = head_program if at is None else jax.jit(lambda top, x, at: head_program(top, x, logits_at=at))
    head_args = (_top(params), x) + (() if at is None else (at,))
    parts.append(Part("head", head_fn, head_args, ("weights", "activations", "activations")[:len(head_args)], 1))
    return Step(name, parts, kv_cache=_cache(model, batch, seq, model.spec.num_layers))


def _adamw() -> Any:
    return optax.adamw(LEARNING_RATE)


def _opt_state(model: AbstractModel, weights: Any) -> Any:
    """The AdamW state of `weights` (abstract), its moments sharded like the weights, its counters replicated."""
    state = jax.eval_shape(_adamw().init, weights)
    wdef = jax.tree_util.tree_structure(weights)
    replicated = NamedSharding(model.mesh, P())

    def shard(node):
        if jax.tree_util.tree_structure(node) == wdef:  # a moment: one leaf per weight
            return jax.tree_util.tree_map(lambda s, w: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=w.sharding),
                                          node, weights)
        return jax.ShapeDtypeStruct(node.shape, node.dtype, sharding=replicated)
    return jax.tree_util.tree_map(shard, state, is_leaf=lambda n: jax.tree_util.tree_structure(n) == wdef)


def _train_program(forward: Callable, with_loss: bool = False) -> Any:
    """jit of (weights, opt_state, *inputs, cotangent) -> (new weights, new opt_state, d inputs[0]): the vjp of
    `forward(weights, *inputs)` and one AdamW update; with_loss: forward returns a scalar loss (no cotangent)."""
    opt = _adamw()

    def step(weights, opt_state, *rest):
        inputs, ct = (rest, None) if with_loss else (rest[:-1], rest[-1])
        out, vjp = jax.vjp(lambda w, x0: forward(w, x0, *inputs[1:]), weights, inputs[0])
        gw, gx = vjp(jnp.ones_like(out) if with_loss else ct)
        updates, opt_state = opt.update(gw, opt_state, weights)
        return optax.apply_updates(weights, updates), opt_state, gx
    return jax.jit(step, donate_argnums=(0, 1))


def _train_step(model: AbstractModel, batch: int, seq: int) -> Step:
    spec, params = model.spec, model.params
    mesh = (model.mesh, model.expert_axis)
    ids = _rep(model, (batch, seq), jnp.int32)
    ctx = _ctx(model, batch, seq, seq)
    x, cos, sin = jax.eval_shape(functools.partial(embed, spec=spec), {"embed": params["embed"]}, ids, ctx)
    x, cos, sin = (_rep(model, a.shape, a.dtype) for a in (x, cos, sin))
    _, blocks, _ = _blocks(model)
    kinds = tuple(zip(spec.windows, model.moe_configs))
    parts = []
    emb = {"embed": params["embed"]}
    # the embedding's part: the cotangent of x in, the table's gradient (a scatter-add) and its update
    embed_fwd = lambda w, table_ids, ctx: embed(w, table_ids, ctx, spec)[0]
    parts.append(Part("embed", _train_program(lambda w, i, c: embed_fwd(w, i, c)),
                      (emb, _opt_state(model, emb), ids, ctx, x), ("weights", "optimizer", "activations",
                                                                   "activations", "activations"), 1))
    for start, stop, _, count in blocks:
        def block_fwd(lps, x, cos, sin, ctx, _kinds=kinds[start:stop]):
            for lp, (window, moe_config) in zip(lps, _kinds):
                x, _, _ = decoder_layer(lp, x, cos, sin, ctx, None, spec=spec, window=window,
                                        moe_config=moe_config, expert_mesh=mesh)
            return x
        lps = params["layers"][start:stop]
        parts.append(Part(f"layers {start}-{stop - 1}" if stop - start > 1 else f"layer {start}",
                          _train_program(block_fwd), (lps, _opt_state(model, lps), x, cos, sin, ctx, x),
                          ("weights", "optimizer") + ("activations",) * 5, count, stop - start))

    def loss(top, x, labels):  # next-token cross-entropy over the B x S positions
        logits = head(top, x, spec)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))
    top = _top(params)
    parts.append(Part("head", _train_program(loss, with_loss=True), (top, _opt_state(model, top), x, ids),
                      ("weights", "optimizer", "activations", "activations"), 1))
    return Step("train", parts, optimizer=_opt_state(model, params))


def build_steps(model: AbstractModel, batch: int, seq: int, mode: str) -> list[Step]:
    """The steps of `mode`: 'serve' -> [prefill, decode], 'train' -> [train] (see the module docstring)."""
    check_choice(mode, "mode", MODES)
    if mode == "train":
        return [_train_step(model, batch, seq)]
    return [_serve_step(model, "prefill", batch, seq), _serve_step(model, "decode", batch, seq)]
