"""HF checkpoint -> parameter pytree, as name tables (levanter style: our path -> on-disk name + transform).

Layer parameters (`{i}` is the layer index in the on-disk names):
  attention   'attn': {q_proj, k_proj, v_proj, o_proj, [q_bias, k_bias, v_bias, o_bias], [q_norm, k_norm], [sinks]}
              or MLA {q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}
  norms       input_layernorm, post_attention_layernorm  [M]
  ffn         'moe': the tutel-jax MoE block params (`checkpoint.hf_moe.hf_moe_block`), or 'mlp': dense SwiGLU
Linear weights keep the on-disk [out, in] layout. The per-tensor transform is a cast to the model dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from ..checkpoint.hf_moe import hf_moe_block
from .spec import DecoderSpec

__all__ = ["attention_table", "load_params"]

Table = dict[str, str]


def attention_table(spec: DecoderSpec) -> Table:
    """Our attention param name -> on-disk name under `model.layers.{i}.self_attn.`."""
    if spec.mla is not None:
        t = {k: f"{k}.weight" for k in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")}
        t.update({k: f"{k}.weight" for k in (("q_a_proj", "q_a_layernorm", "q_b_proj") if spec.mla.q_lora_rank
                                             else ("q_proj",))})
        return t
    t = {f"{n}_proj": f"{n}_proj.weight" for n in "qkvo"}
    if spec.attention_bias:
        t.update({f"{n}_bias": f"{n}_proj.bias" for n in "qkvo"})
    if spec.qk_norm:
        t.update(q_norm="q_norm.weight", k_norm="k_norm.weight")
    if spec.sinks:
        t["sinks"] = "sinks"
    return t


def _mlp_prefix(spec: DecoderSpec) -> str:
    return "block_sparse_moe." if spec.model_type == "mixtral" else "mlp."


def _take(tensors: Mapping[str, np.ndarray], name: str, cast: Callable) -> Any:
    if name not in tensors:
        raise ValueError(f"checkpoint has no tensor {name!r}")
    return cast(np.asarray(tensors[name]))


def load_params(tensors: Mapping[str, np.ndarray], config: Mapping[str, Any], spec: DecoderSpec,
                dtype: Any = jnp.float32) -> tuple[dict, tuple]:
    """(params, moe_configs): the model's parameter pytree and, per layer, its MoEConfig (None: dense layer).

    tensors: the checkpoint by on-disk name (e.g. `safetensors_io.open_checkpoint(dir)`), read lazily.
    """
    cast = lambda a: jnp.asarray(a, dtype)
    attn = attention_table(spec)
    layers, moe_configs = [], []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        layer = {"attn": {k: _take(tensors, p + "self_attn." + v, cast) for k, v in attn.items()},
                 "input_layernorm": _take(tensors, p + "input_layernorm.weight", cast),
                 "post_attention_layernorm": _take(tensors, p + "post_attention_layernorm.weight", cast)}
        if spec.ffn[i] == "moe":
            moe_config, layer["moe"] = hf_moe_block(tensors, config, i, capacity_factor=0.0,
                                                    dtype=jnp.dtype(dtype).name)
            moe_configs.append(moe_config)
        else:
            mp = p + _mlp_prefix(spec)
            layer["mlp"] = {k: _take(tensors, f"{mp}{k}.weight", cast) for k in ("gate_proj", "up_proj", "down_proj")}
            moe_configs.append(None)
        layers.append(layer)
    params = {"embed": _take(tensors, "model.embed_tokens.weight", cast), "layers": layers,
              "norm": _take(tensors, "model.norm.weight", cast)}
    if not spec.tie_word_embeddings:  # tied: forward uses params["embed"]
        params["lm_head"] = _take(tensors, "lm_head.weight", cast)
    return params, tuple(moe_configs)
