"""CausalLM: an HF MoE decoder as a pure function over a parameter pytree, plus a small holder object.

    model = from_pretrained("tests/fixtures/hf/qwen3_moe")
    logits = model(input_ids)                      # [B, T] -> float32 [B, T, V]
    logits, cache = model.apply(model.params, ids, ctx, cache)   # KV-cache step (see serving.generate)

MoE layers run through the tutel-jax MoE block (`moe_apply`; dropless: each gate's default `capacity_factor=0.0`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..checkpoint.safetensors_io import open_checkpoint
from ..layer import moe_apply, route
from ..parallel.expert_sliced import moe_apply_expert_sliced
from .attention import cache_dims, gqa_attention, mla_attention
from .dequant import DequantizedTensors, QuantizedTensors, check_quantization_config, is_quantized
from .hf_tables import load_params
from .placement import MeshPlacement
from .quant_layout import check_checkpoint_header
from .layers import AttnContext, check_dense_impl, rms_norm, rope_cos_sin, swiglu_mlp, unembed
from .spec import DecoderSpec, read_config, spec_from_config

__all__ = ["CausalLM", "forward", "decoder_layer", "embed", "head", "from_pretrained", "context_from_mask",
           "PER_LAYER_MIN_LAYERS", "PER_LAYER_JIT_CHOICES"]

#: from_pretrained(per_layer_jit='auto') compiles per kind of block of layers from this depth on (a shallow model
#: compiles fast as one program, and its steps are short enough for per-block dispatch to show)
PER_LAYER_MIN_LAYERS = 8
#: the command-line spellings of from_pretrained's per_layer_jit (`tutel-jax serve --per-layer-jit`)
PER_LAYER_JIT_CHOICES = {"auto": "auto", "on": True, "off": False}


def context_from_mask(attention_mask: jax.Array) -> AttnContext:
    """No-cache context of a [B, T] 0/1 mask (left or right padding): positions = cumsum(mask) - 1."""
    mask = attention_mask.astype(bool)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0).astype(jnp.int32)
    return AttnContext(positions, jnp.zeros((), jnp.int32), mask)


def embed(params: dict, input_ids: jax.Array, ctx: AttnContext, spec: DecoderSpec):
    """The decoder's input: (x [B, T, M] the token embeddings, cos / sin [B, T, rope_dim] of ctx.positions)."""
    x = jnp.take(params["embed"], input_ids, axis=0)
    cos, sin = rope_cos_sin(ctx.positions, np.asarray(spec.inv_freq, np.float32), spec.attention_factor)
    return x, cos, sin


def decoder_layer(lp: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, ctx: AttnContext,
                  cache: dict | None = None, *, spec: DecoderSpec, window: int | None, moe_config: Any,
                  expert_mesh: tuple[Any, str] | None = None,
                  moe_fn: Callable[[dict, jax.Array], tuple[jax.Array, Any]] | None = None):
    """One pre-norm block, x [B, T, M] -> (x + attn(norm(x)) + ffn(norm(.)), new cache, h [B, T, M] the FFN
    input). Everything that varies between layers is an argument: window (the sliding window, None: full) and
    moe_config (None: a dense SwiGLU MLP), so layers of one kind share one compiled program (`layer_programs`).
    moe_fn(moe_params, h) -> (y, aux) replaces the MoE block (see `forward`)."""
    attn = mla_attention if spec.mla is not None else gqa_attention
    a, cache = attn(lp["attn"], rms_norm(x, lp["input_layernorm"], spec.eps), cos, sin, ctx, spec, window, cache)
    x = x + a
    h = rms_norm(x, lp["post_attention_layernorm"], spec.eps)
    if moe_config is None:
        y = swiglu_mlp(lp["mlp"], h, spec.dense_impl)
    elif moe_fn is not None:
        y, _ = moe_fn(lp["moe"], h)
    elif expert_mesh is None:
        y, _ = moe_apply(lp["moe"], h, moe_config)  # dropless: the gate default (moe_block)
    else:
        y, _ = moe_apply_expert_sliced(lp["moe"], h, moe_config, *expert_mesh)
    return x + y, cache, h


def head(params: dict, x: jax.Array, spec: DecoderSpec, logits_at: jax.Array | None = None) -> jax.Array:
    """float32 logits of the last hidden states x [B, T, M]: [B, T, V], or [B, 1, V] at logits_at [B]."""
    if logits_at is not None:
        x = jnp.take_along_axis(x, jnp.asarray(logits_at, jnp.int32).reshape(-1, 1, 1), axis=1)  # [B, 1, M]
    x = rms_norm(x, params["norm"], spec.eps)
    # lm_head [V, M] as stored (tied: the embedding)
    logits = unembed(x, params["lm_head"] if "lm_head" in params else params["embed"], spec.dense_impl)
    return logits.astype(jnp.float32)


def forward(params: dict, input_ids: jax.Array, ctx: AttnContext, cache: list | None = None, *,
            spec: DecoderSpec, moe_configs: tuple, return_router: bool = False,
            expert_mesh: tuple[Any, str] | None = None,
            moe_fn: Callable[[int, dict, jax.Array], tuple[jax.Array, Any]] | None = None,
            logits_at: jax.Array | None = None):
    """Logits of the T new tokens (one traced program: embed, every `decoder_layer`, head).

    Args:
      params: from `hf_tables.load_params`.
      input_ids: [B, T] int.
      ctx: positions [B, T], cache index, key_valid [B, L] (L = T without a cache).
      spec, moe_configs: static model description.
      cache: per-layer {'k', 'v'} [B, Hkv, L, D] or None.
      return_router: also return the last MoE layer's (ids [B, T, k], weights [B, T, k]).
      expert_mesh: (mesh, expert_axis) when the routed experts are split over that mesh axis: each MoE layer
        runs `parallel.expert_sliced` (every device its own experts on all tokens, one all-reduce).
      moe_fn: `moe_fn(i, moe_params, h [B, T, M]) -> (y [B, T, M], aux)` runs MoE layer i instead of
        `moe_apply` / expert_mesh (e.g. a trainer's expert-parallel layer; forward drops aux, moe_fn may record it).
      logits_at: [B] int, the one new token per row whose logits are wanted (a prefill samples from one
        position: the lm_head then runs on B rows instead of B x T).
    Returns:
      (logits float32 [B, T, V] (with logits_at: [B, 1, V]), new cache or None[, router]).
    """
    x, cos, sin = embed(params, input_ids, ctx, spec)
    new_cache, router = [], None
    for i, lp in enumerate(params["layers"]):
        layer_moe = None if moe_fn is None else functools.partial(moe_fn, i)
        x, c, h = decoder_layer(lp, x, cos, sin, ctx, None if cache is None else cache[i], spec=spec,
                                window=spec.windows[i], moe_config=moe_configs[i], expert_mesh=expert_mesh,
                                moe_fn=layer_moe)
        new_cache.append(c)
        if return_router and i == spec.last_moe_layer:
            plan, _ = route(lp["moe"]["gates"][0], h.reshape(-1, h.shape[-1]).astype(moe_configs[i].dtype),
                            moe_configs[i])
            shape = h.shape[:2] + (-1,)
            router = (plan.expert_ids.T.reshape(shape), plan.gates.T.reshape(shape))
    out = (head(params, x, spec, logits_at), None if cache is None else new_cache)
    return out + (router,) if return_router else out


@dataclasses.dataclass
class CausalLM:
    """An HF MoE causal LM: `spec` and `moe_configs` are static, `params` a pytree. Call it on [B, T] ids."""

    spec: DecoderSpec
    params: dict
    moe_configs: tuple
    config: dict
    dtype: Any = jnp.float32
    expert_mesh: tuple[Any, str] | None = None  # (mesh, expert_axis) of a model placed with from_pretrained(mesh=)
    per_layer_jit: bool = False  # forward_fn compiles one program per kind of block of layers (`layer_programs`)

    def __post_init__(self):
        from .layer_programs import LayerPrograms  # it builds on this module's forward
        # pure (params, input_ids, ctx, cache=None, return_router=False) -> (logits, cache[, router])
        whole = functools.partial(forward, spec=self.spec, moe_configs=self.moe_configs,
                                  expert_mesh=self.expert_mesh)
        self._fwd = jax.jit(whole, static_argnames=("return_router",))
        # (params, input_ids, ctx, cache=None, logits_at=None) -> (logits, cache): traced inside a caller's jit
        self.forward_fn = LayerPrograms(self.spec, self.moe_configs, self.expert_mesh) if self.per_layer_jit \
            else whole

    def apply(self, params: dict, input_ids: jax.Array, ctx: AttnContext, cache: list | None = None,
              return_router: bool = False):
        """`forward` (see there), jitted; with per_layer_jit (and no return_router) one program per kind of block."""
        if self.per_layer_jit and not return_router:
            return self.forward_fn(params, input_ids, ctx, cache)
        return self._fwd(params, input_ids, ctx, cache=cache, return_router=return_router)

    def __call__(self, input_ids, attention_mask=None) -> jax.Array:
        """input_ids [B, T] (attention_mask [B, T], 1 = token) -> float32 logits [B, T, V]."""
        input_ids = jnp.asarray(input_ids, jnp.int32)
        mask = jnp.ones(input_ids.shape, bool) if attention_mask is None else jnp.asarray(attention_mask)
        return self.apply(self.params, input_ids, context_from_mask(mask))[0]

    def router_choices(self, input_ids, attention_mask=None) -> tuple[np.ndarray, np.ndarray]:
        """The last MoE layer's choices for every token: (ids [B, T, k] sorted ascending, weights [B, T, k])."""
        input_ids = jnp.asarray(input_ids, jnp.int32)
        mask = jnp.ones(input_ids.shape, bool) if attention_mask is None else jnp.asarray(attention_mask)
        _, _, (ids, w) = self.apply(self.params, input_ids, context_from_mask(mask), return_router=True)
        ids, w = np.asarray(ids), np.asarray(w)
        order = np.argsort(ids, axis=-1)
        return np.take_along_axis(ids, order, -1), np.take_along_axis(w, order, -1)

    def init_cache(self, batch: int, length: int) -> list[dict]:
        """Zero KV cache: per layer {'k': [B, Hkv, L, Dk], 'v': [B, Hkv, L, Dv]} in the model dtype."""
        heads, dk, dv = cache_dims(self.spec)
        return [{"k": jnp.zeros((batch, heads, length, dk), self.dtype),
                 "v": jnp.zeros((batch, heads, length, dv), self.dtype)} for _ in range(self.spec.num_layers)]


def from_pretrained(path: str | os.PathLike, dtype: Any = jnp.float32,
                    tensors: Mapping[str, np.ndarray] | None = None, *, dequantize: bool = False,
                    progress: bool | None = None, mesh: Any = None, expert_axis: str = "expert",
                    kernel_backend: str | None = None, dropless_impl: str = "auto", dense_impl: str = "auto",
                    per_layer_jit: bool | str = "auto", check_finite: bool = True) -> CausalLM:
    """CausalLM from an HF checkpoint directory (config.json + model.safetensors or a sharded index).

    Quantized checkpoints (FP8 128x128 blocks, MXFP4, NVFP4; `quantization_config` in config.json) keep their
    weights packed in memory (`dequant.QuantizedTensors`); the matmuls dequantize (`tutel_jax.quant_weights`).
    `dequantize=True` (or FP8 with other block sizes) dequantizes to float32 at load instead.
    With a `mesh` (jax.sharding.Mesh), the routed experts are split over its `expert_axis` and each device
    receives only its own experts' slices while the checkpoint is read (`placement.MeshPlacement`); other
    weights are replicated; each MoE layer then runs expert-sliced (`parallel.expert_sliced`: every device its
    own experts on all the tokens, the outputs all-reduced; expert weights are never gathered).
    `kernel_backend` of the MoE layers' gating, dispatch and expert matmuls (None / 'auto', the default: the
    kernels of the platform the program is compiled for, plain XLA on CPUs; or 'xla', 'pallas', 'interpret',
    'tpu', 'tpu_interpret'; see `tutel_jax.execution`).
    `dropless_impl` of the MoE layers (see `tutel_jax.dropless`; 'auto': on CPU the loop over the used experts
    for a few tokens and the bucketed one otherwise, ragged on GPUs; with a mesh, per device; 'native': the
    C++ CPU kernel for SwiGLU and GPT-OSS experts, float or packed, the fastest CPU decode, checked and built
    here; 'auto' picks it on CPU for packed experts).
    `dense_impl` of the attention projections, dense MLPs and lm_head (`layers.linear`: 'xla', 'native' (the
    C++ CPU kernel `native.dense`) or 'auto': native on CPU for decode-sized batches of bfloat16 or packed
    weights).
    `per_layer_jit`: compile one program per kind of block of layers (`layer_programs`: compile time flat with depth,
    one dispatch per layer) instead of one program for the whole model; 'auto': for models of at least
    PER_LAYER_MIN_LAYERS layers.
    `check_finite` (default on): every tensor read from the checkpoint is checked for non-finite values as it
    is read (float tensors for NaN/inf, FP8 weights and the quantization scales, MXFP4 E8M0, FP8
    weight_scale_inv, NVFP4 e4m3 and global scales, for their NaN codes; see `checkpoint.safetensors_io`), so a
    corrupt file (flipped bits) fails at load instead of giving NaN logits: `NonFiniteTensorError` (a
    ValueError) naming the file, the tensor and the count. It costs a pass over each tensor while it is copied
    out of the mmap; `check_finite=False` skips it.
    `tensors` overrides the checkpoint's tensors (the caller's arrays: not finite-checked). `progress`: a
    per-layer progress bar (None: when stderr is a terminal). Errors (ValueError naming the file or tensor;
    nothing partial is returned): unknown model_type, missing config.json / shard / tensor, bad safetensors
    header, shapes that contradict the config, non-finite weights (above).
    """
    path = Path(path)
    config_file = path / "config.json"
    config = read_config(config_file)  # bounded: size and nesting checked before parsing
    # every field the loaders read, checked in one pass before anything is sized from the config
    spec = spec_from_config(config, where=str(config_file))
    try:
        check_quantization_config(config)
    except ValueError as e:
        raise ValueError(f"{config_file}: {e}") from None
    spec = dataclasses.replace(spec, dense_impl=check_dense_impl(dense_impl))
    if per_layer_jit not in (True, False, "auto"):
        raise ValueError(f"per_layer_jit must be True, False or 'auto', got {per_layer_jit!r}")
    if per_layer_jit == "auto":
        per_layer_jit = spec.num_layers >= PER_LAYER_MIN_LAYERS
    ckpt = open_checkpoint(path, check_finite=check_finite) if tensors is None else tensors
    try:
        if tensors is None:  # tensor count, bytes, names, dtypes and shapes from the headers: nothing read yet
            check_checkpoint_header(ckpt, config, where=str(config_file))
        source = ckpt
        if is_quantized(config):
            source = QuantizedTensors(ckpt, config)
            if dequantize or not source.fp8_block_supported():
                source = DequantizedTensors(ckpt, config)
        place = None if mesh is None else MeshPlacement(mesh, expert_axis)
        params, moe_configs = load_params(source, config, spec, dtype, progress=progress, place=place,
                                          moe_options={"kernel_backend": kernel_backend, "dropless_impl": dropless_impl})
    finally:
        if tensors is None:
            ckpt.close()
    return CausalLM(spec=spec, params=params, moe_configs=moe_configs, config=config, dtype=dtype,
                    expert_mesh=None if mesh is None else (mesh, expert_axis), per_layer_jit=per_layer_jit)
