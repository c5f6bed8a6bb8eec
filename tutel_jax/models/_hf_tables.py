"""HF checkpoint -> parameter pytree, as name tables (levanter style: our path -> on-disk name + transform).

Layer parameters (`{i}` is the layer index in the on-disk names):
  attention   'attn': {q_proj, k_proj, v_proj, o_proj, [q_bias, k_bias, v_bias, o_bias], [q_norm, k_norm], [sinks]}
              (which of them: the family's `DecoderSpec` options, `models.families`)
              or MLA {q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}
  norms       input_layernorm, post_attention_layernorm  [M]
  ffn         'moe': the tutel-jax MoE block params (`moe_block.hf_moe_block`), or 'mlp': dense SwiGLU
              `{gate,up,down}_proj` under the family's FFN prefix
Linear weights keep the on-disk [out, in] layout and GQA float q/k/v become one fused weight (`param_layout`);
each tensor is then cast to the model dtype (quantized weights stay packed: `quant` containers).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from .. import quant
from .families import get_family
from ._moe_block import num_experts_of, hf_moe_block
from ._param_layout import to_memory
from ._spec import DecoderSpec

__all__ = ["attention_table", "mlp_prefix", "load_params", "expected_shapes", "implied_tensor_count"]

Table = dict[str, str]


def attention_table(spec: DecoderSpec) -> Table:
    """Our attention param name -> on-disk name under `model.layers.{i}.self_attn.`."""
    if spec.mla is not None:
        t = {k: f"{k}.weight" for k in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")}
        t.update({k: f"{k}.weight" for k in (("q_a_proj", "q_a_layernorm", "q_b_proj") if spec.mla.q_lora_rank
                                             else ("q_proj",))})
        return t
    t = {f"{n}_proj": f"{n}_proj.weight" for n in "qkvo"}
    if spec.attention_bias or spec.qkv_bias:
        t.update({f"{n}_bias": f"{n}_proj.bias" for n in ("qkvo" if spec.attention_bias else "qkv")})
    if spec.qk_norm:
        t.update(q_norm="q_norm.weight", k_norm="k_norm.weight")
    if spec.sinks:
        t["sinks"] = "sinks"
    return t


def mlp_prefix(spec: DecoderSpec) -> str:
    """The FFN module under `model.layers.{i}.` (the family's `ffn_prefix`: 'mlp.', Mixtral 'block_sparse_moe.')."""
    return get_family(spec.model_type).ffn_prefix


def expected_shapes(spec: DecoderSpec, config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Logical shapes ([out, in] for linears) of a layer's attention ('attn.<name>'), norms and dense MLP."""
    M, D, H, Hkv = spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads
    if spec.mla is not None:
        m = spec.mla
        qk = m.qk_nope_dim + m.qk_rope_dim
        attn = {"kv_a_proj_with_mqa": (m.kv_lora_rank + m.qk_rope_dim, M), "kv_a_layernorm": (m.kv_lora_rank,),
                "kv_b_proj": (H * (m.qk_nope_dim + m.v_dim), m.kv_lora_rank), "o_proj": (M, H * m.v_dim)}
        if m.q_lora_rank:
            attn.update(q_a_proj=(m.q_lora_rank, M), q_a_layernorm=(m.q_lora_rank,), q_b_proj=(H * qk, m.q_lora_rank))
        else:
            attn["q_proj"] = (H * qk, M)
    else:
        attn = {"q_proj": (H * D, M), "k_proj": (Hkv * D, M), "v_proj": (Hkv * D, M), "o_proj": (M, H * D),
                "q_bias": (H * D,), "k_bias": (Hkv * D,), "v_bias": (Hkv * D,), "o_bias": (M,),
                "q_norm": (D,), "k_norm": (D,), "sinks": (H,)}
        if spec.qk_norm == "projection":  # over the whole q / k projection (OLMoE)
            attn.update(q_norm=(H * D,), k_norm=(Hkv * D,))
    out = {f"attn.{k}": v for k, v in attn.items()}
    inter = int(config.get("intermediate_size") or 0)
    out.update({"input_layernorm": (M,), "post_attention_layernorm": (M,), "mlp.gate_proj": (inter, M),
                "mlp.up_proj": (inter, M), "mlp.down_proj": (M, inter), "embed": (spec.vocab_size, M),
                "norm": (M,), "lm_head": (spec.vocab_size, M)})
    return out


def implied_tensor_count(spec: DecoderSpec, config: Mapping[str, Any], *, optional: bool = False) -> int:
    """How many tensors a float checkpoint of `config` holds (`random_init.hf_tensor_shapes`' names), counted
    in closed form without listing them, so that a config naming far more layers or experts than its checkpoint
    holds is refused before any per-tensor table is built. optional=False counts only the required tensors (a
    lower bound for every format: a quantized weight is stored as one or more tensors); optional=True adds the
    optional router tensors (DeepSeek's e_score_correction_bias), matching `len(hf_tensor_shapes(config))`."""
    family = get_family(spec.model_type)
    dense = spec.ffn.count("dense")
    per_layer = len(attention_table(spec)) + 2  # attention, input / post-attention norms
    total = 2 + (0 if spec.tie_word_embeddings else 1) + spec.num_layers * per_layer + 3 * dense
    if dense == spec.num_layers:
        return total
    per_moe = len(family.router_tensors) + (len(family.optional_router_tensors) if optional else 0)
    per_moe += len(family.fused_experts) if family.fused_experts is not None else 3 * num_experts_of(config)
    shared = family.shared_experts(config)
    if shared is not None:
        per_moe += 3 + (shared.gate is not None)
    return total + (spec.num_layers - dense) * per_moe


def _read(tensors: Mapping[str, np.ndarray], name: str, shape: tuple[int, ...] | None = None) -> Any:
    """The on-disk tensor `name` (NumPy or a quantized container), its shape checked against `shape`."""
    if name not in tensors:
        raise ValueError(f"checkpoint has no tensor {name!r}")
    value = tensors[name]
    got = tuple(quant.logical_shape(value))
    if shape is not None and got != tuple(shape):
        raise ValueError(f"tensor {name!r} has shape {got}; the config implies {tuple(shape)}")
    return value


def load_params(tensors: Mapping[str, np.ndarray], config: Mapping[str, Any], spec: DecoderSpec,
                dtype: Any = jnp.float32, progress: bool | None = None,
                place: Callable | None = None, moe_options: Mapping[str, Any] | None = None) -> tuple[dict, tuple]:
    """(params, moe_configs): the model's parameter pytree and, per layer, its MoEConfig (None: dense layer).

    tensors: the checkpoint by on-disk name (e.g. `safetensors_io.open_checkpoint(dir)`), read lazily; every
    tensor's shape is checked against the config (ValueError naming the tensor).
    progress: a per-layer progress bar (None: only when stderr is a terminal).
    place: `place(part, value, dtype)` puts each tensor on devices as it is read (`placement.MeshPlacement`;
      part 'dense' or the MoE block's 'gates' / 'experts' / 'shared_experts'); default: the default device.
    moe_options: more `make_config` arguments for every MoE layer (e.g. kernel_backend, dropless_impl).
    """
    disable = None if progress is None else not progress  # tqdm: None = off unless stderr is a terminal

    place = place or (lambda part, value, dt: quant.to_jax(value, dt))  # containers keep packed dtypes
    cast = lambda a: place("dense", a, dtype)
    attn = attention_table(spec)
    shapes = expected_shapes(spec, config)
    layers, moe_configs = [], []
    bar = tqdm(range(spec.num_layers), desc="loading layers", unit="layer", disable=disable)
    for i in bar:
        p = f"model.layers.{i}."
        on_disk = {k: _read(tensors, p + "self_attn." + v, shapes[f"attn.{k}"]) for k, v in attn.items()}
        layer = {"attn": {k: cast(v) for k, v in to_memory(on_disk, spec).items()},
                 "input_layernorm": cast(_read(tensors, p + "input_layernorm.weight", shapes["input_layernorm"])),
                 "post_attention_layernorm": cast(_read(tensors, p + "post_attention_layernorm.weight",
                                                        shapes["post_attention_layernorm"]))}
        if spec.ffn[i] == "moe":
            moe_config, layer["moe"] = hf_moe_block(tensors, config, i,
                                                    dtype=jnp.dtype(dtype).name, place=place, **(moe_options or {}))
            moe_configs.append(moe_config)
        else:
            mp = p + mlp_prefix(spec)
            layer["mlp"] = {k: cast(_read(tensors, f"{mp}{k}.weight", shapes[f"mlp.{k}"]))
                            for k in ("gate_proj", "up_proj", "down_proj")}
            moe_configs.append(None)
        layers.append(layer)
    params = {"embed": cast(_read(tensors, "model.embed_tokens.weight", shapes["embed"])), "layers": layers,
              "norm": cast(_read(tensors, "model.norm.weight", shapes["norm"]))}
    if not spec.tie_word_embeddings:  # tied: forward uses params["embed"]
        params["lm_head"] = cast(_read(tensors, "lm_head.weight", shapes["lm_head"]))  # [V, M] as stored
    return params, tuple(moe_configs)
