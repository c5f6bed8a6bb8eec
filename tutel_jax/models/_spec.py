"""DecoderSpec: the static shape of an HF MoE decoder, read from its config.json through its family's record
(`models.families`).

config.json is untrusted input: `validate_config` checks it in one pass (types, ranges, the keys each family
requires, cross-field rules) and reports every problem in one ValueError naming the config file and the keys,
before anything is sized from it; `spec_from_config` runs it first.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..validation import Field, check_fields, load_json, raise_problems
from .families import family_names, get_family
from ._family import COMMON_FIELDS, EXPERT_COUNT_KEYS, MAX_HEAD_DIM, MOE_WIDTH_KEYS, MAX_POSITIONS, MAX_WIDTH, Family
from ._layers import rope_inv_freq

__all__ = ["FAMILIES", "MLASpec", "DecoderSpec", "spec_from_config", "validate_config", "read_config",
           "ROPE_TYPES", "MAX_CONFIG_BYTES"]

#: the largest config.json read (MoE configs are a few KB; some carry label maps of a few hundred KB)
MAX_CONFIG_BYTES = 16 << 20

#: the rope_parameters / rope_scaling types `layers.rope_inv_freq` implements
ROPE_TYPES = ("default", "yarn")
#: the layer_types entries (`_windows`)
LAYER_TYPES = ("full_attention", "sliding_attention")
_ROPE_FIELDS: tuple[Field, ...] = (
    Field("rope_type", "str", choices=ROPE_TYPES), Field("type", "str", choices=ROPE_TYPES),
    Field("rope_theta", "real", nullable=False, minimum=0, exclusive_min=True),
    Field("factor", "real", nullable=False, minimum=0, exclusive_min=True),
    Field("original_max_position_embeddings", "int", minimum=1, maximum=MAX_POSITIONS),
    Field("partial_rotary_factor", "real", nullable=False, minimum=0, maximum=1, exclusive_min=True),
    Field("beta_fast", "real"), Field("beta_slow", "real"), Field("mscale", "real"), Field("mscale_all_dim", "real"),
    Field("attention_factor", "real"), Field("truncate", "bool", nullable=False),
)
_QUANT_FIELDS: tuple[Field, ...] = (
    Field("quant_method", "str"), Field("format", "str"),
    Field("weight_block_size", "int_list", minimum=1, maximum=MAX_WIDTH),
    Field("ignore", "str_list"), Field("modules_to_not_convert", "str_list"),
)

#: every supported model_type (families, then aliases); see `models.families`
FAMILIES = family_names()


@dataclasses.dataclass(frozen=True)
class MLASpec:
    """DeepSeek multi-head latent attention dims."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_dim: int
    rope_interleave: bool
    softmax_scale: float


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    """Static description of a pre-norm decoder: embed -> layers (x + attn(norm(x)); x + ffn(norm(x))) ->
    norm -> lm_head. `ffn[i]` is 'moe' or 'dense'; `windows[i]` the sliding window of layer i (None: full)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    inv_freq: tuple[float, ...]
    attention_factor: float
    windows: tuple[int | None, ...]
    ffn: tuple[str, ...]
    qk_norm: str | None = None  # None, 'head' (RMSNorm [D] per head) or 'projection' (over [H*D], OLMoE)
    attention_bias: bool = False  # q/k/v/o biases (GPT-OSS)
    qkv_bias: bool = False  # q/k/v biases only (Qwen2-MoE, GLM-4 MoE)
    rotary_dim: int | None = None  # RoPE on the first rotary_dim dims of each head (GLM-4 MoE); None: all
    sinks: bool = False
    tie_word_embeddings: bool = False
    mla: MLASpec | None = None
    dense_impl: str = "auto"  # the dense projections' matmul: see `layers.linear` (from_pretrained's dense_impl)
    attention_impl: str = "auto"  # a decode step's attention: see `native.attends_natively` (from_pretrained's)

    @property
    def last_moe_layer(self) -> int | None:
        moe = [i for i, f in enumerate(self.ffn) if f == "moe"]
        return moe[-1] if moe else None


def _rope_params(config: Mapping[str, Any]) -> dict:
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return rope


def _windows(config: Mapping[str, Any], n: int, family: Family) -> tuple[int | None, ...]:
    window = config.get("sliding_window")
    if config.get("layer_types"):
        return tuple(window if t == "sliding_attention" else None for t in config["layer_types"])
    if window and family.sliding_window_every_layer:
        return (int(window),) * n
    if window and config.get("use_sliding_window"):
        raise ValueError(f"{config['model_type']}: use_sliding_window without layer_types is not supported")
    return (None,) * n


def _cross_field_problems(config: Mapping[str, Any], family: Family, rope: Mapping[str, Any]) -> list[str]:
    """The problems between keys whose types and ranges are already valid: experts vs top-k, heads vs kv
    heads, widths the layers need, layer_types, group routing, the rotary width."""
    problems = []
    n, heads, hidden = config["num_hidden_layers"], config["num_attention_heads"], config["hidden_size"]
    experts = next((config[key] for key in EXPERT_COUNT_KEYS if config.get(key)), None)
    k = config["num_experts_per_tok"]
    if experts is None:
        problems.append(f"{' / '.join(EXPERT_COUNT_KEYS)}: missing (one is required: the number of experts)")
    elif k > experts:
        problems.append(f"num_experts_per_tok: {k} is more than the {experts} experts")
    kv = config.get("num_key_value_heads") or heads
    if kv > heads or heads % kv:
        problems.append(f"num_key_value_heads: {kv} must divide num_attention_heads {heads}")
    head_dim = config.get("head_dim")
    if not head_dim and family.mla is None:
        if hidden % heads:
            problems.append(f"head_dim: missing, and hidden_size {hidden} is not a multiple of "
                            f"num_attention_heads {heads}")
        head_dim = hidden // heads
        if head_dim > MAX_HEAD_DIM:
            problems.append(f"head_dim: hidden_size / num_attention_heads = {head_dim} exceeds {MAX_HEAD_DIM}")
    moe = family.moe_layers(config)
    if moe and not any(config.get(key) for key in MOE_WIDTH_KEYS):
        problems.append(f"{' / '.join(MOE_WIDTH_KEYS)}: missing (one is required: the experts' width)")
    if len(moe) < n and not config.get("intermediate_size"):
        problems.append(f"intermediate_size: missing (required: {n - len(moe)} layer(s) have a dense MLP)")
    layer_types = config.get("layer_types")
    if layer_types:
        if len(layer_types) != n:
            problems.append(f"layer_types: {len(layer_types)} entries for num_hidden_layers {n}")
        bad = sorted(set(layer_types) - set(LAYER_TYPES))
        if bad:
            problems.append(f"layer_types: unsupported entries {bad} (supported: {list(LAYER_TYPES)})")
        if "sliding_attention" in layer_types and not config.get("sliding_window"):
            problems.append("sliding_window: must be a positive integer (layer_types has sliding_attention)")
    if "n_group" in (f.key for f in family.config_fields) and experts is not None:
        groups, topk_group = config.get("n_group") or 1, config.get("topk_group") or 1
        if experts % groups:
            problems.append(f"n_group: {groups} does not divide the {experts} experts")
        elif topk_group > groups:
            problems.append(f"topk_group: {topk_group} is more than n_group {groups}")
        elif k > topk_group * (experts // groups):
            problems.append(f"num_experts_per_tok: {k} is more than the {topk_group * (experts // groups)} "
                            f"experts of the topk_group {topk_group} groups")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "yarn" and rope.get("factor") is None:
        problems.append("rope_parameters.factor: missing (required by rope_type 'yarn')")
    if family.mla is not None:
        rotary = config["qk_rope_head_dim"]
        what = "qk_rope_head_dim"
    else:
        factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        rotary, what = int(head_dim * float(factor)), "head_dim x partial_rotary_factor"
    if rotary < 2 or rotary % 2:
        problems.append(f"{what}: the rotary width {rotary} must be a positive even number")
    return problems


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """config.json at `path` as a dict: ValueError naming the file when it is missing, over MAX_CONFIG_BYTES
    (checked before it is read), nested too deeply, not JSON, with a key twice, or not an object. Its fields
    are checked by `validate_config` / `spec_from_config`."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path.parent}: no config.json" if path.name == "config.json" else f"{path}: no such file")
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ValueError(f"{path}: {size} bytes exceed the {MAX_CONFIG_BYTES}-byte limit of a config file")
    config = load_json(path.read_bytes(), str(path), max_bytes=MAX_CONFIG_BYTES)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def validate_config(config: Any, where: str = "config") -> Family:
    """Checks an HF config.json (parsed) before anything is sized from it; returns its family.

    One pass over every key the loaders read: types (an int is no str, bool, float or null; reals are finite),
    ranges (positive layer / head / expert counts and widths, below the `family` MAX_* limits), the keys the
    family requires (e.g. num_experts_per_tok), then rules between keys (top-k <= experts, kv heads dividing
    heads, decoder_sparse_step >= 1, group routing, layer_types, the rotary width, ...) and the family's
    `check_config`. Raises one ValueError '<where>: <key>: <problem>; ...' naming every bad key.
    """
    if not isinstance(config, Mapping):
        raise ValueError(f"{where}: must be a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type")
    family = get_family(model_type)
    if family is None:
        raise ValueError(f"{where}: unsupported model_type {model_type!r:.80}; supported: {family_names()}")
    problems = check_fields(config, COMMON_FIELDS) + check_fields(config, family.config_fields)
    rope_key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    rope = config.get(rope_key) or {}
    if isinstance(rope, Mapping):
        problems += check_fields(rope, _ROPE_FIELDS, prefix=f"{rope_key}.")
    quant = config.get("quantization_config")
    if isinstance(quant, Mapping):
        problems += check_fields(quant, _QUANT_FIELDS, prefix="quantization_config.")
        block = quant.get("weight_block_size")
        if isinstance(block, list) and len(block) != 2:
            problems.append(f"quantization_config.weight_block_size: must be [rows, columns], got {block!r:.80}")
    raise_problems(where, problems)
    raise_problems(where, _cross_field_problems(config, family, rope))
    try:
        family.check_config(config)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return family


def spec_from_config(config: Mapping[str, Any], where: str = "config") -> DecoderSpec:
    """DecoderSpec of an HF config.json dict; ValueError naming `where` (e.g. the config file) and the keys for
    an unknown model_type or an invalid config (`validate_config`)."""
    family = validate_config(config, where)
    try:
        return _spec(config, family)
    except ValueError as e:  # options the family refuses (e.g. use_sliding_window without layer_types)
        raise ValueError(f"{where}: {e}") from None


def _spec(config: Mapping[str, Any], family: Family) -> DecoderSpec:
    """DecoderSpec of a validated config."""
    n = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    rope = _rope_params(config)
    moe = set(family.moe_layers(config))
    mla = None
    if family.mla is not None:
        mla = MLASpec(**family.mla(config, rope))
        rope_dim = mla.qk_rope_dim
    else:  # e.g. GLM-4 MoE rotates only the first partial_rotary_factor of each head
        rope_dim = int(head_dim * float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))))
    inv_freq, attention_factor = rope_inv_freq(rope, rope_dim, int(config.get("max_position_embeddings", 4096)))
    return DecoderSpec(
        model_type=family.name, vocab_size=int(config["vocab_size"]), hidden_size=hidden, num_layers=n,
        num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads), head_dim=head_dim,
        eps=float(config.get("rms_norm_eps", 1e-6)), inv_freq=tuple(float(f) for f in inv_freq),
        attention_factor=attention_factor, windows=_windows(config, n, family),
        ffn=tuple("moe" if i in moe else "dense" for i in range(n)),
        qk_norm=family.qk_norm(config), attention_bias=family.attention_bias(config),
        qkv_bias=family.qkv_bias(config), rotary_dim=None if rope_dim == head_dim or mla is not None else rope_dim,
        sinks=family.sinks, tie_word_embeddings=bool(config.get("tie_word_embeddings", False)), mla=mla)
