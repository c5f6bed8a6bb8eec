"""The record of one Hugging Face model family, and the registry the loaders read it from.

Every family lives in its own module, `models/families/<name>.py` (Levanter style: one file per family), which
fills in a `Family` and calls `register_family`; `models.families` imports each of those modules. Everything that
differs between families is a field of `Family`: `spec` (config.json -> `DecoderSpec`), `hf_tables` (tensor
names), `moe_block` (router, experts, shared experts, which layers are MoE) and `export` (the inverse names)
hold no per-family branches, only lookups here. A family whose parts (an attention option, a router type, an
experts layout, a shared-expert layout) already exist is one new file; a new kind of part is a new field or a
new value of one, implemented once in the generic code.

config.json is untrusted input: `spec.validate_config` checks it in one pass before anything is sized from it,
against `COMMON_FIELDS` (every family) and the family's own `config_fields` (`validation.Field`s: type, range,
whether required), with the size limits below as upper bounds, then the family's `check_config`.

On-disk names are HF's: decoder layer i's modules sit under `model.layers.{i}.`, its attention under
`self_attn.` (names: `hf_tables.attention_table`), its FFN (MoE block or dense MLP) under `Family.ffn_prefix`;
the names in `router_tensors`, `expert_names`, `fused_experts` and `SharedExpertTensors` are relative to that prefix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from ..validation import Field

__all__ = ["Family", "SharedExpertTensors", "register_family", "get_family", "family_of", "family_names",
           "config_flag", "constant", "every_layer", "moe_hidden_size", "COMMON_FIELDS", "MOE_WIDTH_KEYS",
           "EXPERT_COUNT_KEYS", "GROUPED_ROUTER_FIELDS", "SPARSE_STEP_FIELDS", "MAX_LAYERS", "MAX_HEADS",
           "MAX_EXPERTS", "MAX_HEAD_DIM", "MAX_WIDTH", "MAX_VOCAB", "MAX_POSITIONS"]

Config = Mapping[str, Any]

# Upper bounds of config.json's sizes: far above every released model (<= ~128 layers, 128 heads, 512 experts,
# head_dim 256, widths ~30k, vocabularies ~260k), low enough that nothing sized from a config before it is
# compared with the checkpoint's tensors (`quant_layout.check_checkpoint_header`) can take much memory.
MAX_LAYERS = 1 << 14
MAX_HEADS = 1 << 12
MAX_EXPERTS = 1 << 14
MAX_HEAD_DIM = 1 << 12
MAX_WIDTH = 1 << 18  # hidden_size, intermediate sizes, LoRA ranks
MAX_VOCAB = 1 << 24
MAX_POSITIONS = 1 << 31

#: the keys naming the number of routed experts (the first one set is used, `moe_block.num_experts_of`)
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
#: the keys naming a routed expert's width (moe_intermediate_size, else intermediate_size: `moe_hidden_size`)
MOE_WIDTH_KEYS = ("moe_intermediate_size", "intermediate_size")

#: config.json keys every family reads; `Family.config_fields` adds each family's own
COMMON_FIELDS: tuple[Field, ...] = (
    Field("model_type", "str", required=True),
    Field("vocab_size", "int", required=True, minimum=1, maximum=MAX_VOCAB),
    Field("hidden_size", "int", required=True, minimum=1, maximum=MAX_WIDTH),
    Field("num_hidden_layers", "int", required=True, minimum=1, maximum=MAX_LAYERS),
    Field("num_attention_heads", "int", required=True, minimum=1, maximum=MAX_HEADS),
    Field("num_experts_per_tok", "int", required=True, minimum=1, maximum=MAX_EXPERTS),
    Field("num_key_value_heads", "int", minimum=1, maximum=MAX_HEADS),
    Field("head_dim", "int", minimum=1, maximum=MAX_HEAD_DIM),
    Field("intermediate_size", "int", minimum=1, maximum=MAX_WIDTH),
    Field("moe_intermediate_size", "int", minimum=1, maximum=MAX_WIDTH),
    *(Field(key, "int", minimum=1, maximum=MAX_EXPERTS) for key in EXPERT_COUNT_KEYS),
    Field("max_position_embeddings", "int", nullable=False, minimum=1, maximum=MAX_POSITIONS),
    Field("rms_norm_eps", "real", nullable=False, minimum=0, maximum=1, exclusive_min=True),
    Field("rope_theta", "real", nullable=False, minimum=0, exclusive_min=True),
    Field("partial_rotary_factor", "real", nullable=False, minimum=0, maximum=1, exclusive_min=True),
    Field("rope_parameters", "object"),
    Field("rope_scaling", "object"),
    Field("tie_word_embeddings", "bool", nullable=False),
    Field("attention_bias", "bool", nullable=False),
    Field("sliding_window", "int", minimum=0, maximum=MAX_POSITIONS),
    Field("use_sliding_window", "bool", nullable=False),
    Field("layer_types", "str_list"),
    Field("initializer_range", "real", nullable=False, minimum=0, exclusive_min=True),
    Field("dtype", "str"),
    Field("torch_dtype", "str"),
    Field("quantization_config", "object"),
)

#: DeepSeek-V3-style MoE blocks: group-limited routing, shared experts, dense layers first
GROUPED_ROUTER_FIELDS: tuple[Field, ...] = (
    Field("n_group", "int", minimum=1, maximum=MAX_EXPERTS),
    Field("topk_group", "int", minimum=1, maximum=MAX_EXPERTS),
    Field("norm_topk_prob", "bool", nullable=False),
    Field("routed_scaling_factor", "real", nullable=False),
    Field("n_shared_experts", "int", minimum=0, maximum=MAX_EXPERTS),
    Field("first_k_dense_replace", "int", nullable=False, minimum=0, maximum=MAX_LAYERS),
)

#: Qwen-MoE-style layer placement: MoE every decoder_sparse_step layers, except mlp_only_layers
SPARSE_STEP_FIELDS: tuple[Field, ...] = (
    Field("decoder_sparse_step", "int", nullable=False, minimum=1, maximum=MAX_LAYERS),
    Field("mlp_only_layers", "int_list", minimum=0, maximum=MAX_LAYERS - 1),
    Field("norm_topk_prob", "bool", nullable=False),
)


@dataclasses.dataclass(frozen=True)
class SharedExpertTensors:
    """Where a checkpoint keeps a block's always-on dense SwiGLU expert(s) (the layer's `experts.SharedExperts`).

    prefix: under the FFN prefix, the module holding `{gate,up,down}_proj.weight` (e.g. 'shared_experts.').
    hidden_size: its intermediate width (DeepSeek: moe_intermediate_size x n_shared_experts).
    gate: the on-disk name, under the FFN prefix, of a sigmoid gate weight [1, H] scaling the shared output
      per token (Qwen2-MoE's 'shared_expert_gate.weight'), or None (ungated).
    """

    prefix: str
    hidden_size: int
    gate: str | None = None


def constant(value: Any) -> Callable[[Config], Any]:
    """A config -> value field that ignores the config."""
    return lambda config: value


def config_flag(key: str, default: bool = False) -> Callable[[Config], bool]:
    """A config -> bool field reading `config[key]` (default when absent)."""
    return lambda config: bool(config.get(key, default))


def every_layer(config: Config) -> list[int]:
    """`Family.moe_layers` of families whose every decoder layer is MoE."""
    return list(range(int(config["num_hidden_layers"])))


def moe_hidden_size(config: Config) -> int:
    """A routed expert's intermediate width: moe_intermediate_size, else intermediate_size."""
    return int(config.get("moe_intermediate_size") or config["intermediate_size"])


def _no_shared_experts(config: Config) -> None:
    return None


def _accept(config: Config) -> None:
    return None


def _swiglu_experts(config: Config) -> dict:
    return {"type": "swiglu"}


def _default_router_tensors() -> dict[str, str]:
    return {"weight": "gate.weight"}


@dataclasses.dataclass(frozen=True)
class Family:
    """What tutel-jax knows about one HF MoE decoder family (callables take config.json as a dict).

    Identity and checks:
      name: the canonical `model_type`; also `DecoderSpec.model_type` of every model of the family.
      aliases: other model_types that are this family under another name (Kimi-K2 -> deepseek_v3); the
        exported config.json keeps the model's own model_type.
      config_fields: the family's own config.json keys (`validation.Field`s), checked with `COMMON_FIELDS`
        by `spec.validate_config` before anything is sized from the config.
      check_config: raises ValueError for config options the family supports in HF but tutel-jax does not
        (e.g. OLMoE's clip_qkv); called by `spec.validate_config` once the fields are valid.

    Attention (`DecoderSpec` fields, see `attention.gqa_attention`):
      qk_norm: None (no q/k norm), 'head' (RMSNorm [D] per head after the split into heads: Qwen3-MoE,
        GLM-4 MoE) or 'projection' (RMSNorm over the whole q projection [Hq*D] and k projection [Hkv*D],
        before the split: OLMoE). On disk `self_attn.q_norm.weight` / `k_norm.weight`.
      attention_bias: q/k/v/o projections have biases (`self_attn.{q,k,v,o}_proj.bias`).
      qkv_bias: only q/k/v have biases (Qwen2-MoE's qkv_bias, GLM-4 MoE's attention_bias).
      sinks: a per-head attention-sink logit `self_attn.sinks` [Hq] (GPT-OSS).
      sliding_window_every_layer: config's sliding_window applies to every layer although there are no
        layer_types (Mixtral). Otherwise only `layer_types` ('sliding_attention') place windows, and
        use_sliding_window without layer_types is refused.
      mla: None (grouped-query attention), or config, rope parameters -> the `spec.MLASpec` fields as a dict
        (DeepSeek multi-head latent attention; RoPE then covers its qk_rope_dim). Without MLA, RoPE covers
        partial_rotary_factor of each head.

    MoE block (`moe_block.hf_moe_block`; its inverse `hf_moe_block_tensors`):
      ffn_prefix: the FFN module under `model.layers.{i}.` ('mlp.'; Mixtral 'block_sparse_moe.'), for MoE
        blocks and dense MLPs (`{gate,up,down}_proj.weight`) alike.
      moe_layers: config -> the indices of the decoder layers holding an MoE block (the rest are dense).
      router: (config, found) -> the gate's `make_config` dict without k / capacity_factor (e.g.
        {'type': 'qwen3_moe', 'norm_topk_prob': False}); `found` is the frozenset of gate parameter names
        present in the checkpoint (required and optional router tensors).
      router_tensors: gate parameter name -> on-disk name, all required ({'weight': 'gate.weight'}).
      optional_router_tensors: the same for tensors read when present (DeepSeek's e_score_correction_bias).
      experts: config -> the experts' `make_config` dict entries besides count_per_node,
        hidden_size_per_expert and weight_format (type, activation limits, ...).
      expert_names: per-expert SwiGLU layout: the (gate, up, down) modules under `experts.{e}.`, each
        `<name>.weight` [out, in], stacked by the loader (Mixtral ('w1', 'w3', 'w2')).
      fused_experts: None (per-expert layout), or the tensors under `experts.` holding all experts at once
        (GPT-OSS); names ending in '_bias' are biases, the others weights: stored [E, in, out] when float (the
        loader transposes them to the experts' [E, out, in]), [E, out, in] when quantized.
      shared_experts: config -> the block's `SharedExpertTensors`, or None.
    """

    name: str
    router: Callable[[Config, frozenset], dict]
    aliases: tuple[str, ...] = ()
    config_fields: tuple[Field, ...] = ()
    check_config: Callable[[Config], None] = _accept
    qk_norm: Callable[[Config], str | None] = constant(None)
    attention_bias: Callable[[Config], bool] = config_flag("attention_bias")
    qkv_bias: Callable[[Config], bool] = constant(False)
    sinks: bool = False
    sliding_window_every_layer: bool = False
    mla: Callable[[Config, Mapping[str, Any]], dict] | None = None
    ffn_prefix: str = "mlp."
    moe_layers: Callable[[Config], list[int]] = every_layer
    router_tensors: Mapping[str, str] = dataclasses.field(default_factory=_default_router_tensors)
    optional_router_tensors: Mapping[str, str] = dataclasses.field(default_factory=dict)
    experts: Callable[[Config], dict] = _swiglu_experts
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    fused_experts: tuple[str, ...] | None = None
    shared_experts: Callable[[Config], SharedExpertTensors | None] = _no_shared_experts

    def router_tensor_names(self) -> dict[str, str]:
        """Every gate parameter name -> on-disk name (required and optional)."""
        return {**self.router_tensors, **self.optional_router_tensors}


_FAMILIES: dict[str, Family] = {}
_ALIASES: dict[str, str] = {}


def register_family(family: Family) -> Family:
    """Adds `family` to the registry under its name and aliases (ValueError if one is taken); returns it."""
    taken = [n for n in (family.name,) + tuple(family.aliases) if n in _FAMILIES or n in _ALIASES]
    if taken:
        raise ValueError(f"model_type {taken} already registered")
    _FAMILIES[family.name] = family
    _ALIASES.update({alias: family.name for alias in family.aliases})
    return family


def family_names() -> tuple[str, ...]:
    """Every supported model_type: the families in registration order, then the aliases."""
    return tuple(_FAMILIES) + tuple(_ALIASES)


def get_family(model_type: Any) -> Family | None:
    """The family of a model_type (aliases resolved), or None."""
    if not isinstance(model_type, str):
        return None
    return _FAMILIES.get(_ALIASES.get(model_type, model_type))


def family_of(config: Config) -> Family:
    """The family of config.json's model_type; ValueError naming the supported ones otherwise."""
    family = get_family(config.get("model_type"))
    if family is None:
        raise ValueError(f"unsupported model_type {config.get('model_type')!r}; supported: {family_names()}")
    return family
