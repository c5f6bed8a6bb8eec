"""A Qwen3-MoE-style byte-level language model: its size, random init, training loss, evaluation and export.

    size = LMSize()                                       # 4 layers, 8 experts top-2, vocab 256 (bytes)
    model = init_lm(size, seed=0)                         # a models.CausalLM (HF qwen3_moe layout)
    loss_fn = functools.partial(lm_loss, model=model)     # loss_fn(params, batch, moe) -> (loss, metrics)
    trainer = MoETrainer(moe_config(model), loss_fn, optax.adamw(3e-3), model.params, RuntimeConfig.ep(8))
    bits_per_byte(float(lm_eval(trainer.state.params, tokens, model=model)))
    export_lm(model, trainer.state.params, "out/")        # HF checkpoint + byte tokenizer: from_pretrained / serve

The model is a plain `models.CausalLM`: its params pytree has exactly the layout `models.save_pretrained` writes
and `models.from_pretrained` reads (every MoE layer's params a dict {'gates', 'experts'}, which is how
`MoETrainer` finds and shards them). Token ids are UTF-8 bytes (`byte_tokenizer`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from ..layer import MoEConfig, MoEAux, moe_apply
from ..runtime import LOAD_RATIO_KEY, load_ratio
from ..models import CausalLM, forward, save_pretrained, load_params, AttnContext, random_hf_tensors, spec_from_config
from ._byte_tokenizer import VOCAB_SIZE, write_tokenizer
from ..validation import check_int

__all__ = ["LMSize", "init_lm", "moe_config", "causal_context", "lm_loss", "lm_eval", "bits_per_byte", "export_lm"]

_INT_FIELDS = ("hidden", "layers", "heads", "kv_heads", "head_dim", "experts", "top_k", "expert_hidden", "vocab",
               "max_len")


@dataclasses.dataclass(frozen=True)
class LMSize:
    """The shape of a Qwen3-MoE decoder: `layers` layers of width `hidden`, grouped-query attention (`heads`
    query heads, `kv_heads` key/value heads of `head_dim`, RMSNorm on q / k heads, RoPE base `rope_theta`), each
    with an MoE block of `experts` SwiGLU experts of width `expert_hidden`, `top_k` per token (softmax router,
    renormalised top-k). `dense`: the dense baseline instead, every layer a SwiGLU MLP of width
    top_k * expert_hidden (the same active parameters per token, router aside). `vocab` >= 256 (byte ids),
    contexts up to `max_len`, weights drawn N(0, initializer_range)."""

    hidden: int = 192
    layers: int = 4
    heads: int = 6
    kv_heads: int = 2
    head_dim: int = 32
    experts: int = 8
    top_k: int = 2
    expert_hidden: int = 384
    vocab: int = 256
    max_len: int = 2048
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    dense: bool = False

    def __post_init__(self):
        for name in _INT_FIELDS:
            check_int(getattr(self, name), f"LMSize.{name}", minimum=1)
        for name in ("rope_theta", "initializer_range"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise ValueError(f"LMSize.{name} must be a positive finite number, got {v!r}")
        if not isinstance(self.dense, bool):
            raise ValueError(f"LMSize.dense must be a bool, got {self.dense!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"LMSize.heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.top_k > self.experts:
            raise ValueError(f"LMSize.top_k ({self.top_k}) must be <= experts ({self.experts})")
        if self.head_dim % 2:
            raise ValueError(f"LMSize.head_dim must be even (RoPE rotates half-dims), got {self.head_dim}")
        if self.vocab < VOCAB_SIZE:
            raise ValueError(f"LMSize.vocab must be >= {VOCAB_SIZE} (every byte is a token id), got {self.vocab}")

    @property
    def dense_hidden(self) -> int:
        """The dense MLP width with the MoE's active FFN parameters: top_k * expert_hidden."""
        return self.top_k * self.expert_hidden

    def hf_config(self) -> dict[str, Any]:
        """The qwen3_moe config.json (float32, no BOS / EOS / padding ids, norm_topk_prob, router_aux_loss_coef
        0.01); with `dense` every layer is in mlp_only_layers, of width intermediate_size = top_k * expert_hidden."""
        return {
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "dtype": "float32",
            "vocab_size": self.vocab, "hidden_size": self.hidden, "intermediate_size": self.dense_hidden,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim, "hidden_act": "silu",
            "max_position_embeddings": self.max_len, "initializer_range": float(self.initializer_range),
            "rms_norm_eps": 1e-6, "use_cache": True, "tie_word_embeddings": False,
            "rope_parameters": {"rope_theta": float(self.rope_theta), "rope_type": "default"},
            "attention_bias": False, "use_sliding_window": False, "sliding_window": None, "attention_dropout": 0.0,
            "decoder_sparse_step": 1, "mlp_only_layers": list(range(self.layers)) if self.dense else [],
            "moe_intermediate_size": self.expert_hidden, "num_experts_per_tok": self.top_k,
            "num_local_experts": self.experts, "norm_topk_prob": True, "output_router_logits": False,
            "router_aux_loss_coef": 0.01, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
        }

    def dense_baseline(self) -> LMSize:
        """This size with `dense=True`."""
        return dataclasses.replace(self, dense=True)

    def _shared_params(self) -> int:
        """Embedding, lm_head, final norm, and per layer the attention (q/k/v/o, q/k norms) and the two norms."""
        M, D = self.hidden, self.head_dim
        attn = M * self.heads * D * 2 + M * self.kv_heads * D * 2 + 2 * D
        return 2 * self.vocab * M + M + self.layers * (attn + 2 * M)

    def active_params(self) -> int:
        """Parameters one token's forward pass multiplies with: everything but the experts not chosen, router
        weights ([E, M] per MoE layer, scores only) not counted either; equal for an MoE size and its dense
        baseline."""
        return self._shared_params() + self.layers * 3 * self.hidden * self.dense_hidden

    def total_params(self) -> int:
        """Every parameter of the model (MoE: all experts and the routers)."""
        if self.dense:
            return self.active_params()
        M, E = self.hidden, self.experts
        return self._shared_params() + self.layers * (E * 3 * M * self.expert_hidden + E * M)


def init_lm(size: LMSize, seed: int = 0) -> CausalLM:
    """A random model of `size`: `models.random_init.random_hf_tensors` of `size.hf_config()` (HF's init:
    matrices N(0, initializer_range), norms 1; deterministic per seed) loaded as `from_pretrained` would load
    that checkpoint (float32; MoE layers dropless with dropless_impl 'auto')."""
    if not isinstance(size, LMSize):
        raise ValueError(f"init_lm: size must be an LMSize, got {type(size).__name__}")
    config = size.hf_config()
    spec = spec_from_config(config)
    params, moe_configs = load_params(random_hf_tensors(config, seed), config, spec, jnp.float32, progress=False,
                                      moe_options={"kernel_backend": None, "dropless_impl": "auto"})
    return CausalLM(spec=spec, params=params, moe_configs=moe_configs, config=config, dtype=jnp.float32)


def moe_config(model: CausalLM) -> MoEConfig:
    """The one MoEConfig every MoE layer of `model` shares (what `MoETrainer` takes). ValueError when the model
    has no MoE layer (a dense baseline: give the trainer its MoE sibling's config) or the layers differ."""
    configs = {c for c in model.moe_configs if c is not None}
    if len(configs) != 1:
        raise ValueError(f"moe_config: the model has {len(configs)} distinct MoE layer configs, expected one")
    return configs.pop()


def _tokens(tokens: Any, where: str) -> jax.Array:
    """Checks a token batch: int [B, T + 1] with T >= 1."""
    shape, dtype = tuple(getattr(tokens, "shape", ())), getattr(tokens, "dtype", None)
    if len(shape) != 2 or shape[1] < 2 or dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"{where} must be int token ids [B, T + 1] with T >= 1, got shape {shape} dtype {dtype}")
    return jnp.asarray(tokens, jnp.int32)


def causal_context(batch: int, length: int) -> AttnContext:
    """Attention context of full, unpadded causal sequences: positions arange(T) per row, no cache."""
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    return AttnContext(positions, jnp.zeros((), jnp.int32), jnp.ones((batch, length), bool))


def _next_token_ce(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross entropy in nats of float32 logits [B, T, V] against targets [B, T]: [] float32."""
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - picked)


MoEFn = Callable[[Any, jax.Array], tuple[jax.Array, MoEAux]]


def lm_loss(params: dict, batch: Mapping[str, Any], moe: MoEFn | None = None, *, model: CausalLM,
            aux_weight: float | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Next-token training loss, `MoETrainer`'s `loss_fn` (bind `model` with functools.partial).

    Args:
      params: the model's params pytree (`model.params` layout).
      batch: {"tokens": int [B, T + 1]}; the model reads tokens[:, :-1] (positions 0..T-1) and predicts
        tokens[:, 1:].
      moe: `moe(layer_params, x [B, T, M]) -> (y, MoEAux)` running each MoE layer (the trainer's `MoECall`);
        None: the model's own single-device `moe_apply` (deterministic).
      model: gives spec, moe_configs and the config's router_aux_loss_coef.
      aux_weight: weight of the load-balancing loss; None: config router_aux_loss_coef (0 when absent).
    Returns:
      (loss [] float32 = ce + aux_weight * l_aux, metrics): "ce" [] mean cross entropy over the B*T predictions
      in nats; "l_aux" [] the MoE layers' l_aux summed; "dropped" [L_moe] float32, each MoE layer's
      dropped_fraction; "load" [L_moe, E] float32, each MoE layer's dispatch_count / its sum.
    """
    if not isinstance(batch, Mapping) or "tokens" not in batch:
        raise ValueError(f"lm_loss: batch must be a mapping with 'tokens', got {type(batch).__name__}")
    tokens = _tokens(batch["tokens"], "lm_loss: batch['tokens']")
    B, T = tokens.shape[0], tokens.shape[1] - 1
    auxes: list[MoEAux] = []  # filled while tracing, in layer order

    def run_moe(i: int, layer_params: dict, h: jax.Array) -> tuple[jax.Array, MoEAux]:
        y, aux = moe_apply(layer_params, h, model.moe_configs[i]) if moe is None else moe(layer_params, h)
        auxes.append(aux)
        return y, aux

    logits, _ = forward(params, tokens[:, :-1], causal_context(B, T), spec=model.spec,
                        moe_configs=model.moe_configs, moe_fn=run_moe)
    ce = _next_token_ce(logits, tokens[:, 1:])
    weight = float(model.config.get("router_aux_loss_coef") or 0.0) if aux_weight is None else float(aux_weight)
    experts = int(model.config.get("num_local_experts") or model.config.get("num_experts") or 0)
    if auxes:
        l_aux = sum(a.l_aux.astype(jnp.float32) for a in auxes)
        dropped = jnp.stack([a.dropped_fraction.astype(jnp.float32) for a in auxes])
        counts = jnp.stack([a.dispatch_count.astype(jnp.float32) for a in auxes])
        load = counts / jnp.maximum(jnp.sum(counts, axis=-1, keepdims=True), 1.0)
    else:  # dense baseline
        l_aux, dropped, load = jnp.zeros((), jnp.float32), jnp.zeros((0,), jnp.float32), jnp.zeros((0, experts))
    metrics = {"ce": ce, "l_aux": l_aux, "dropped": dropped, "load": load.astype(jnp.float32)}
    if auxes:  # the most crowded layer's load-imbalance ratio: what `MoETrainer.autotune` re-tunes on
        metrics[LOAD_RATIO_KEY] = jnp.max(jnp.stack([load_ratio(a) for a in auxes]))
    return ce + weight * l_aux, metrics


@functools.lru_cache(maxsize=32)
def _eval_program(spec: Any, moe_configs: tuple) -> Callable[[dict, jax.Array], jax.Array]:
    def mean_ce(params: dict, tokens: jax.Array) -> jax.Array:
        logits, _ = forward(params, tokens[:, :-1], causal_context(tokens.shape[0], tokens.shape[1] - 1),
                            spec=spec, moe_configs=moe_configs)
        return _next_token_ce(logits, tokens[:, 1:])

    return jax.jit(mean_ce)


def lm_eval(params: dict, tokens: Any, *, model: CausalLM) -> jax.Array:
    """Mean next-token cross entropy in nats, [] float32, of tokens int [B, T + 1] (predicting tokens[:, 1:]
    from tokens[:, :-1]): no aux loss, no gate noise, the model's single-device MoE layers; jitted."""
    return _eval_program(model.spec, model.moe_configs)(params, _tokens(tokens, "lm_eval: tokens"))


def bits_per_byte(nats: float) -> float:
    """Cross entropy per byte token in nats -> bits per byte (nats / ln 2)."""
    return float(nats) / math.log(2.0)


def _check_params(model: CausalLM, params: Any) -> None:
    want = jax.tree_util.tree_flatten_with_path(model.params)[0]
    got = jax.tree_util.tree_flatten_with_path(params)[0]
    if [p for p, _ in got] != [p for p, _ in want]:
        raise ValueError("export_lm: params do not have the model's layout (keys differ from model.params)")
    for (path, a), (_, b) in zip(got, want):
        if tuple(a.shape) != tuple(b.shape):
            raise ValueError(f"export_lm: params{jax.tree_util.keystr(path)} has shape {tuple(a.shape)}, the model "
                             f"has {tuple(b.shape)}")


def export_lm(model: CausalLM, params: dict, path: str | os.PathLike) -> Path:
    """Writes `model` with `params` (e.g. trained ones) as an HF checkpoint directory: config.json +
    model.safetensors (`models.save_pretrained`) + the byte tokenizer (tokenizer.json, tokenizer_config.json
    with a chat template), so that `models.from_pretrained(path)`, `tutel_jax.serving` and `tutel-jax serve
    path` generate text from it. Returns the directory. ValueError for params of another layout or a vocab
    smaller than 256."""
    if model.spec.vocab_size < VOCAB_SIZE:
        raise ValueError(f"export_lm: the byte tokenizer needs vocab_size >= {VOCAB_SIZE}, the model has "
                         f"{model.spec.vocab_size}")
    _check_params(model, params)
    out = save_pretrained(dataclasses.replace(model, params=params), path)
    write_tokenizer(out, model_max_length=model.config.get("max_position_embeddings"))
    return out
