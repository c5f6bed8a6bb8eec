"""CausalLM: an HF MoE decoder as a pure function over a parameter pytree, plus a small holder object.

    model = from_pretrained("tests/fixtures/hf/qwen3_moe")
    logits = model(input_ids)                      # [B, T] -> float32 [B, T, V]
    logits, cache = model.apply(model.params, ids, ctx, cache)   # KV-cache step (see serving.generate)

The function itself (embed, one `decoder_layer` per layer, head) is `decoder.forward`; `layer_programs` runs the
same pieces as one compiled program per kind of block of layers.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..checkpoint import open_checkpoint
from ..core import collapse_to_huge_pages, platform
from ..native import check_attention_impl, compact_pays_off
from ._attention import cache_dims
from ._decoder import context_from_mask, forward
from ._dequant import DequantizedTensors, QuantizedTensors, check_quantization_config, is_quantized
from ._hf_tables import load_params
from ._layer_programs import LayerPrograms
from ._layers import AttnContext, check_dense_impl
from ._param_layout import absorbed_mla_weights, compact_bf16_weights
from ._placement import MeshPlacement
from ._quant_layout import auto_compute_dtype, check_checkpoint_header
from ._spec import DecoderSpec, read_config, spec_from_config

__all__ = ["CausalLM", "from_pretrained", "PER_LAYER_MIN_LAYERS", "PER_LAYER_JIT_CHOICES"]

#: from_pretrained(per_layer_jit='auto') compiles per kind of block of layers from this depth on. Below it the
#: whole model is one program: it compiles in seconds (GPT-OSS-20B's 24 layers: a decode step 2.6 s, against 1.4 s
#: per block), and a step's per-block dispatches cost host time that on a CPU takes a core from the step's kernels
#: (GPT-OSS-20B on 2 cores: the one-program decode step ~10% faster at batch 1 and 8)
PER_LAYER_MIN_LAYERS = 32
#: the command-line spellings of from_pretrained's per_layer_jit (`tutel-jax serve --per-layer-jit`)
PER_LAYER_JIT_CHOICES = {"auto": "auto", "on": True, "off": False}


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
                    attention_impl: str = "auto", per_layer_jit: bool | str = "auto",
                    check_finite: bool = True, compact_bf16: bool | str = "auto") -> CausalLM:
    """CausalLM from an HF checkpoint directory (config.json + model.safetensors or a sharded index).

    `dtype` of the float weights and activations (packed expert weights stay packed); 'auto': the checkpoint's
    own where it is bfloat16, else float32 (`quant_layout.auto_compute_dtype`).

    Quantized checkpoints (FP8 128x128 blocks, MXFP4, NVFP4; `quantization_config` in config.json) keep their
    weights packed in memory (`dequant.QuantizedTensors`); the matmuls dequantize (`tutel_jax.quant._weights`).
    `dequantize=True` (or FP8 with other block sizes) dequantizes to float32 at load instead.
    With a `mesh` (jax.sharding.Mesh), the routed experts are split over its `expert_axis` and each device
    receives only its own experts' slices while the checkpoint is read (`placement.MeshPlacement`); other
    weights are replicated; each MoE layer then runs expert-sliced (`parallel.expert_sliced`: every device its
    own experts on all the tokens, the outputs all-reduced; expert weights are never gathered).
    `kernel_backend` of the MoE layers' gating, dispatch and expert matmuls (None / 'auto', the default: the
    kernels of the platform the program is compiled for, plain XLA on CPUs; or 'xla', 'pallas', 'interpret',
    'tpu', 'tpu_interpret'; see `tutel_jax.layer._execution`).
    `dropless_impl` of the MoE layers (see `tutel_jax.experts._dropless`; 'auto': on CPU the loop over the used experts
    for a few tokens and the bucketed one otherwise, ragged on GPUs; with a mesh, per device; 'native': the
    C++ CPU kernel for SwiGLU and GPT-OSS experts, float or packed, the fastest CPU decode, checked and built
    here; 'native_int8': the same with MXFP4 / NVFP4 experts multiplied by int8 activations (per block of 32,
    llama.cpp's Q8_0); 'auto' picks 'native_int8' on CPU for FP4 experts and 'native' for FP8 ones).
    `dense_impl` of the attention projections, dense MLPs and lm_head (`layers.linear`: 'xla', 'native' (the
    C++ CPU kernel `native.dense`), 'native_int8' (FP4 weights times int8 activations) or 'auto': native on
    CPU for decode-sized batches of bfloat16 or packed weights, int8 activations for FP4 ones).
    `attention_impl` of a decode step's attention (`native.attends_natively`: 'xla', 'native' (the C++ CPU
    kernel: the cache update and the attention in one call) or 'auto': native on CPU where the kernel builds);
    a prefill's attention is XLA's.
    `per_layer_jit`: compile one program per kind of block of layers (`layer_programs`: compile time flat with depth,
    one dispatch per block of up to `layer_programs.MAX_LAYERS_PER_PROGRAM` layers) instead of one program for
    the whole model; 'auto': for models of at least PER_LAYER_MIN_LAYERS layers.
    `check_finite` (default on): every tensor read from the checkpoint is checked for non-finite values as it
    is read (float tensors for NaN/inf, FP8 weights and the quantization scales, MXFP4 E8M0, FP8
    weight_scale_inv, NVFP4 e4m3 and global scales, for their NaN codes; see `checkpoint.safetensors_io`), so a
    corrupt file (flipped bits) fails at load instead of giving NaN logits: `NonFiniteTensorError` (a
    ValueError) naming the file, the tensor and the count. It costs a pass over each tensor while it is read
    (in cache); `check_finite=False` skips it.
    `compact_bf16`: hold a bfloat16 model's attention projections, dense MLPs and lm_head as
    `native.CompactBf16` (the same values in 12 bits per element, decoded in registers by the native dense kernel:
    3/4 of the bytes a decode step reads; `param_layout.compact_bf16_weights`); True, False or 'auto' (the
    default: where the native dense kernel runs them, i.e. a bfloat16 model on CPU, no mesh, dense_impl 'auto' or
    'native', and an x86 build, which decodes the codes faster than memory delivers them,
    `native.compact_pays_off`).
    An MLA model on CPU without a mesh also holds each layer's kv_b_proj halves absorbed, as per-head stacks in
    `dtype` (`param_layout.absorbed_mla_weights`): its decode steps read them instead of dequantizing kv_b_proj
    at every step.
    The loaded weights of 4 MiB and more are moved onto 2 MiB pages where the kernel can
    (`core.collapse_to_huge_pages`, Linux): a decode step streams them all, and a core reads huge pages faster.
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
    if isinstance(dtype, str) and dtype == "auto":
        try:
            dtype = jnp.dtype(auto_compute_dtype(config))
        except ValueError as e:
            raise ValueError(f"{config_file}: {e}") from None
    try:
        check_quantization_config(config)
    except ValueError as e:
        raise ValueError(f"{config_file}: {e}") from None
    spec = dataclasses.replace(spec, dense_impl=check_dense_impl(dense_impl),
                               attention_impl=check_attention_impl(attention_impl))
    if per_layer_jit not in (True, False, "auto"):
        raise ValueError(f"per_layer_jit must be True, False or 'auto', got {per_layer_jit!r}")
    if per_layer_jit == "auto":
        per_layer_jit = spec.num_layers >= PER_LAYER_MIN_LAYERS
    if compact_bf16 not in (True, False, "auto"):
        raise ValueError(f"compact_bf16 must be True, False or 'auto', got {compact_bf16!r}")
    if compact_bf16 == "auto":
        compact_bf16 = (jnp.dtype(dtype) == jnp.bfloat16 and mesh is None and spec.dense_impl in ("auto", "native")
                        and compact_pays_off())
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
    if spec.mla is not None and mesh is None and platform() == "cpu":
        params = absorbed_mla_weights(params, spec, dtype)
    if compact_bf16:
        params = compact_bf16_weights(params)
    collapse_to_huge_pages(params)  # a decode step streams them all: 2 MiB pages read faster (host_memory)
    return CausalLM(spec=spec, params=params, moe_configs=moe_configs, config=config, dtype=dtype,
                    expert_mesh=None if mesh is None else (mesh, expert_axis), per_layer_jit=per_layer_jit)
