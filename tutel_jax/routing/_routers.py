"""Modern routers as gates: Mixtral, Qwen3-MoE, DeepSeek-V3 / Kimi-K2 / GLM, GPT-OSS, Switch and expert choice.

Each router is a pure selection function `(logits [S, E], ...) -> RouterChoices` (expert ids [k, S], combine
weights [k, S], normalised probabilities [S, E] for the balance losses), written from the Hugging Face
transformers 5.24 formulas, and a frozen-dataclass gate that owns the router's parameters:

  init(key, model_dim, num_experts, dtype) -> {'weight': [E, M], ('bias': [E]), ('e_score_correction_bias': [E])}
  logits(params, x [S, M]) -> [S, E]        (float32 when `fp32_gate`, the default)
  select(params, logits, k) -> RouterChoices
  kernel_gating(params, k, E) -> dict | None   (how `pallas_kernels.gating` reproduces `select`'s choices)
  choices_for_ids(params, logits, ids [k, S]) -> RouterChoices   (`select`'s weights for given choices)

(the `Gate` protocol of `routing.gates`). The routing pipeline (`routing.pipeline.route_tokens`, called by
`layer.route`) turns the choices into a RoutingPlan with `plan_from_choices` (Tutel's slot order and capacity
rules), so every router works with the capacity path (cf > 0, < 0), the dropless path (cf = 0, the default
here: the HF models are dropless) and expert parallelism. Expert choice has no per-token choices: its gate
defines `plan(...)` instead of `select(...)` and builds the plan directly.

Ties: every top-k here breaks ties towards the lower index (expert, group or token), the order of
`jax.lax.top_k`. Choices of a token are ordered by descending selection score; the k weights are not re-sorted.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from pallas_kernels.gating import group_limited, normalize_weights

from ..validation import check_choice, check_int
from ._gates import GATE_TYPES, Gate, torch_linear_init
from ._plan import RoutingPlan, align_capacity

__all__ = [
    "RouterChoices", "softmax_topk", "softmax_choices", "topk_softmax", "sigmoid_group_topk", "sigmoid_choices",
    "expert_choice_plan",
    "expert_choice_capacity", "SoftmaxRouter", "MixtralRouter", "Qwen3MoeRouter", "SwitchRouter", "GptOssRouter",
    "DeepSeekV3Router", "ExpertChoiceRouter", "AUX_LOSSES", "CORRECTION_BIAS", "trainable_mask",
]

AUX_LOSSES = ("switch", "gshard", "seq_aux", "none")
CORRECTION_BIAS = "e_score_correction_bias"  # name of the non-trainable selection bias in a gate's params


@dataclasses.dataclass(frozen=True)
class RouterChoices:
    """What a router chose for S tokens.

    Attributes:
      expert_ids: [k, S] int32, the k distinct experts of each token, by descending selection score.
      weights: [k, S] float, the combine weight of each choice (after any renormalisation and scaling).
      probs: [S, E] float32, normalised affinities of every expert (rows sum to 1), for the balance losses.
    """

    expert_ids: jax.Array
    weights: jax.Array
    probs: jax.Array


jax.tree_util.register_dataclass(RouterChoices, data_fields=["expert_ids", "weights", "probs"], meta_fields=[])


def _check_k(k: int, num_experts: int) -> int:
    check_int(k, "top_k", minimum=1)
    if k > num_experts:
        raise ValueError(f"top_k = {k} exceeds the number of experts {num_experts}")
    return k


def softmax_topk(logits: jax.Array, k: int, normalize: bool) -> RouterChoices:
    """Mixtral / Qwen3-MoE / Switch: `p = softmax(logits)` (float32), top-k of p, optionally `w /= sum(w)`.

    Args:
      logits: [S, E] router logits.
      k: experts per token.
      normalize: renormalise the k weights to sum to 1 (Mixtral always; Qwen3-MoE `norm_topk_prob`).
    """
    k = _check_k(k, logits.shape[1])
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, ids = jax.lax.top_k(probs, k)
    return RouterChoices(ids.T.astype(jnp.int32), _renormalize(top, normalize).T, probs)


def softmax_choices(logits: jax.Array, expert_ids: jax.Array, normalize: bool) -> RouterChoices:
    """`softmax_topk`'s weights and probs for experts chosen elsewhere (e.g. by the fused gating kernel).

    Args:
      logits: [S, E] router logits; the weights are differentiable functions of them.
      expert_ids: [k, S] int, the experts `softmax_topk` would choose (no gradient).
      normalize: as in `softmax_topk`.
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top = jnp.take_along_axis(probs, expert_ids.T, axis=1)  # [S, k]: the values top_k would return
    return RouterChoices(expert_ids.astype(jnp.int32), _renormalize(top, normalize).T, probs)


def _renormalize(top: jax.Array, normalize: bool) -> jax.Array:
    """[S, k] chosen probabilities, divided by their sum when `normalize` (HF: no epsilon)."""
    return top / jnp.sum(top, axis=-1, keepdims=True) if normalize else top


def topk_softmax(logits: jax.Array, k: int) -> RouterChoices:
    """GPT-OSS: top-k of the logits, then softmax over those k (the weights always sum to 1)."""
    k = _check_k(k, logits.shape[1])
    logits = logits.astype(jnp.float32)
    top, ids = jax.lax.top_k(logits, k)
    weights = jax.nn.softmax(top, axis=-1)
    return RouterChoices(ids.T.astype(jnp.int32), weights.T, jax.nn.softmax(logits, axis=-1))


def sigmoid_group_topk(
    logits: jax.Array,
    k: int,
    correction_bias: jax.Array | None = None,
    *,
    n_group: int = 1,
    topk_group: int = 1,
    normalize: bool = True,
    routed_scaling_factor: float = 1.0,
    group_mask_value: float = 0.0,
) -> RouterChoices:
    """DeepSeek-V3 / Kimi-K2 / GLM-4.5 router (HF `DeepseekV3MoE.route_tokens_to_experts`).

    `s = sigmoid(logits)`; selection scores `b = s + correction_bias`; experts form `n_group` consecutive groups
    of E / n_group; a group's score is the sum of its two largest b; the `topk_group` best groups are kept and
    the other experts' selection scores set to `group_mask_value` (HF: 0.0, so a masked expert can still win
    over a kept one whose biased score is negative; DeepSeek's own code uses -inf); the top-k of the masked b
    are chosen. Weights come from the UNBIASED s of the chosen experts, divided by `sum + 1e-20` when
    `normalize`, times `routed_scaling_factor`. The bias only steers selection and gets no gradient.

    Args:
      logits: [S, E] router logits (float32 in HF).
      k: experts per token.
      correction_bias: optional [E] selection bias (`e_score_correction_bias`).
      n_group, topk_group: group-limited routing (n_group = 1: plain top-k).
      normalize: `norm_topk_prob`.
      routed_scaling_factor: multiplies the final weights.
      group_mask_value: selection score given to experts outside the kept groups.
    """
    num_experts = logits.shape[1]
    k = _check_k(k, num_experts)
    _check_groups(n_group, topk_group, num_experts)
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    biased = scores
    if correction_bias is not None:
        biased = scores + jax.lax.stop_gradient(correction_bias.astype(jnp.float32))[None, :]
    biased = jax.lax.stop_gradient(biased)
    if n_group > 1:
        biased = group_limited(biased, n_group, topk_group, group_mask_value)
    _, ids = jax.lax.top_k(biased, k)
    weights = _sigmoid_weights(scores, ids, normalize, routed_scaling_factor)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    return RouterChoices(ids.T.astype(jnp.int32), weights.T, probs)


def sigmoid_choices(logits: jax.Array, expert_ids: jax.Array, *, normalize: bool = True,
                    routed_scaling_factor: float = 1.0) -> RouterChoices:
    """`sigmoid_group_topk`'s weights and probs for experts chosen elsewhere (e.g. by the fused gating kernel).

    Args:
      logits: [S, E] router logits; the weights are differentiable functions of them.
      expert_ids: [k, S] int, the experts `sigmoid_group_topk` would choose (no gradient).
      normalize, routed_scaling_factor: as in `sigmoid_group_topk`.
    """
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    weights = _sigmoid_weights(scores, expert_ids.T, normalize, routed_scaling_factor)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    return RouterChoices(expert_ids.astype(jnp.int32), weights.T, probs)


def _sigmoid_weights(scores: jax.Array, ids: jax.Array, normalize: bool, routed_scaling_factor: float
                     ) -> jax.Array:
    """[S, k] combine weights: the unbiased scores [S, E] of the chosen experts ids [S, k], divided by
    `sum + 1e-20` when `normalize`, times `routed_scaling_factor`."""
    return normalize_weights(jnp.take_along_axis(scores, ids, axis=1), "sigmoid", normalize, routed_scaling_factor,
                             axis=-1)


def _check_groups(n_group: int, topk_group: int, num_experts: int) -> None:
    """Raises ValueError unless n_group divides E and 1 <= topk_group <= n_group (integers)."""
    if num_experts % check_int(n_group, "n_group", minimum=1):
        raise ValueError(f"n_group must divide the number of experts {num_experts}, got {n_group!r}")
    check_int(topk_group, f"topk_group (n_group={n_group})", minimum=1, maximum=n_group)


def expert_choice_capacity(num_tokens: int, num_experts: int, capacity_factor: float, alignment: int = 1) -> int:
    """Tokens each expert takes in expert-choice routing: `max(1, floor(cf * S / E))`, aligned.

    `capacity_factor` is the average number of experts per token (Zhou et al.'s c)."""
    if not capacity_factor > 0:
        raise ValueError(f"expert_choice routing needs capacity_factor > 0 (average experts per token), "
                         f"got {capacity_factor}")
    return align_capacity(max(1, math.floor(capacity_factor * num_tokens / num_experts)), alignment)


def expert_choice_plan(
    probs: jax.Array,
    capacity_factor: float,
    *,
    alignment: int = 1,
    valid: jax.Array | None = None,
    num_tokens_for_capacity: int | None = None,
) -> RoutingPlan:
    """Expert-choice routing (Zhou et al. 2022): each expert takes its top-C tokens by `probs[:, e]`.

    The plan has one "choice" row per expert (k = E): `expert_ids[e, s] = e`; `locations[e, s]` is the rank of
    token s among expert e's picks, or int32 max when e did not pick s; `gates[e, s] = probs[s, e]` for a pick,
    else 0. A token may be picked by 0 to E experts. Ties go to the lower token index.

    Args:
      probs: [S, E] token-to-expert affinities (softmax over experts).
      capacity_factor: average experts per token c; C = `expert_choice_capacity(S, E, c, alignment)`.
      alignment: round C up to a multiple of this.
      valid: optional [S] bool; padding tokens are never picked.
      num_tokens_for_capacity: static S used for C (default: this call's S); C is capped at S.

    Returns:
      A RoutingPlan with buffer_capacity = C and dispatch_count = picks per expert.
    """
    num_tokens, num_experts = probs.shape
    count = num_tokens if num_tokens_for_capacity is None else num_tokens_for_capacity
    if not isinstance(count, int):
        count = num_tokens  # a traced count cannot size the buffer: use this device's S
    capacity = expert_choice_capacity(count, num_experts, capacity_factor, alignment)
    pick = min(capacity, num_tokens)
    sel = jax.lax.stop_gradient(probs.T)  # [E, S]
    if valid is not None:
        sel = jnp.where(valid[None, :], sel, -jnp.inf)
    top_vals, top_tok = jax.lax.top_k(sel, pick)  # [E, pick]
    picked = jnp.isfinite(top_vals)
    big = jnp.iinfo(jnp.int32).max
    rank = jnp.broadcast_to(jnp.arange(pick, dtype=jnp.int32), (num_experts, pick))
    locations = jnp.full((num_experts, num_tokens), big, jnp.int32).at[
        jnp.arange(num_experts)[:, None], top_tok].set(jnp.where(picked, rank, big))
    gates = jnp.where(locations < big, probs.T, 0)
    expert_ids = jnp.broadcast_to(jnp.arange(num_experts, dtype=jnp.int32)[:, None], (num_experts, num_tokens))
    return RoutingPlan(
        expert_ids=expert_ids, locations=locations, gates=gates,
        dispatch_count=jnp.sum(picked, axis=1).astype(jnp.int32), capacity=jnp.int32(capacity),
        num_experts=num_experts, buffer_capacity=capacity)


def trainable_mask(params: Any) -> Any:
    """Same pytree as `params` with False at every `e_score_correction_bias` and True elsewhere.

    For the functional core and Linen: `optax.masked(tx, trainable_mask(params))` keeps the optimizer (weight
    decay included) off the selection bias, which `update_correction_bias` updates instead. (Its gradient is
    exactly zero: it only steers the top-k.) The NNX module needs no mask: the bias is a `RouterState`."""
    def leaf(path, _):
        last = path[-1] if path else None
        return getattr(last, "key", None) != CORRECTION_BIAS
    return jax.tree_util.tree_map_with_path(leaf, params)


# -- gates ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _LinearRouter(Gate):
    """Common fields of the linear routers.

    Attributes:
      k: experts per token.
      capacity_factor: Tutel's rules (> 0 fixed, 0 dropless, < 0 bounded); default 0, dropless like HF.
      gate_noise: training-time additive logit noise `gate_noise * N(0, 1) / E` (Tutel's convention).
      jitter: training-time multiplicative input jitter `x * U(1 - jitter, 1 + jitter)` applied to the router's
        input only (Switch / Mixtral `router_jitter_noise`).
      fp32_gate: compute the logits in float32 (HF's DeepSeek router does; the others use the model dtype).
      aux_loss: which loss is the layer's `l_aux`: 'switch' (E * sum f_e P_e), 'gshard', 'seq_aux'
        (DeepSeek sequence-wise), or 'none'; every one of them is reported in `MoEAux.losses` regardless.
      z_loss_weight: `l_aux += z_loss_weight * z_loss` (relative to the aux loss weight the caller applies).
    """

    k: int = 2
    capacity_factor: float = 0.0
    gate_noise: float = 0.0
    jitter: float = 0.0
    fp32_gate: bool = True
    aux_loss: str = "switch"
    z_loss_weight: float = 0.0

    def __post_init__(self):
        check_choice(self.aux_loss, "aux_loss", AUX_LOSSES)
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter!r}")

    has_bias = False  # a bias on the router's linear layer (GPT-OSS)

    def init(self, key, model_dim, num_experts, dtype):
        dtype = jnp.float32 if self.fp32_gate else dtype
        weight, bias = torch_linear_init(key, num_experts, model_dim, dtype, bias=self.has_bias)
        return {"weight": weight} if bias is None else {"weight": weight, "bias": bias}

    def logits(self, params, x):
        w = params["weight"]
        if self.fp32_gate:
            w, x = w.astype(jnp.float32), x.astype(jnp.float32)
        out = jnp.einsum("...m,em->...e", x.astype(w.dtype), w, precision=jax.lax.Precision.HIGHEST)
        if "bias" in params:
            out = out + params["bias"].astype(out.dtype)
        return out

    # kernel_gating (default None: not expressible, use `select`) and choices_for_ids: see `Gate`. A router
    # that the fused gating kernel reproduces returns the `pallas_kernels.gating` keyword arguments (score_fn,
    # correction_bias, n_group, topk_group, group_fill_value, normalize, routed_scaling_factor) under which
    # the kernel picks exactly the expert ids [k, S] of `select(params, logits, k)`, ties included; the
    # pipeline then takes the kernel's ids and slots and recomputes the weights with `choices_for_ids`.


def _overrides_select(gate: Any, cls: type) -> bool:
    """True when `gate`'s class replaces `cls.select`: `cls.kernel_gating` no longer describes it."""
    return type(gate).select is not cls.select


@dataclasses.dataclass(frozen=True)
class SoftmaxRouter(_LinearRouter):
    """Softmax top-k router; `norm_topk_prob` renormalises the k weights (Qwen2/3-MoE, OLMoE)."""

    norm_topk_prob: bool = False

    def select(self, params, logits, k):
        return softmax_topk(logits, k, self.norm_topk_prob)

    def kernel_gating(self, params, k: int, num_experts: int) -> dict | None:
        """Softmax scores, plain top-k: the kernel's choices are `softmax_topk`'s (same formula, lowest index
        on ties). Its weights differ in rounding only (it guards the sum with eps and skips k = 1), which is
        why the layer recomputes them."""
        if not 1 <= k <= num_experts or _overrides_select(self, SoftmaxRouter):
            return None  # `select` raises the error / a subclass selects its own way
        return {"score_fn": "softmax", "normalize": self.norm_topk_prob}

    def choices_for_ids(self, params, logits, expert_ids):
        return softmax_choices(logits, expert_ids, self.norm_topk_prob)


@dataclasses.dataclass(frozen=True)
class Qwen3MoeRouter(SoftmaxRouter):
    """Qwen3-MoE (and Qwen2-MoE): softmax, top-k, renormalised iff `norm_topk_prob` (HF default False)."""


@dataclasses.dataclass(frozen=True)
class MixtralRouter(SoftmaxRouter):
    """Mixtral: softmax over all experts, top-k, renormalise the k weights."""

    norm_topk_prob: bool = True


@dataclasses.dataclass(frozen=True)
class SwitchRouter(SoftmaxRouter):
    """Switch Transformer: top-1 of the softmax, weight = that probability, with capacity (cf 1.0)."""

    k: int = 1
    capacity_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class GptOssRouter(_LinearRouter):
    """GPT-OSS: `logits = x @ W.T + b`; top-k of the logits; softmax over the k."""

    has_bias = True

    def select(self, params, logits, k):
        return topk_softmax(logits, k)

    def kernel_gating(self, params, k: int, num_experts: int) -> dict | None:
        """None: top-k of the logits is not top-k of the kernel's softmax scores when two different logits
        round to the same probability (e.g. both underflow to 0): the kernel then takes the lower index."""
        return None


@dataclasses.dataclass(frozen=True)
class DeepSeekV3Router(_LinearRouter):
    """DeepSeek-V3 / Kimi-K2 / GLM-4.5+: sigmoid scores, group-limited top-k on `s + e_score_correction_bias`.

    Parameters: 'weight' [E, M] and, with `correction_bias`, 'e_score_correction_bias' [E] float32, a
    NON-trainable state updated outside the optimizer by `losses.update_correction_bias` (aux-loss-free
    balancing; the NNX module stores it as a `RouterState` variable, not an `nnx.Param`). See `sigmoid_group_topk`.
    """

    k: int = 8
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    correction_bias: bool = True
    group_mask_value: float = 0.0
    aux_loss: str = "seq_aux"

    def init(self, key, model_dim, num_experts, dtype):
        params = super().init(key, model_dim, num_experts, dtype)
        if num_experts % self.n_group:
            raise ValueError(f"n_group = {self.n_group} must divide the number of experts {num_experts}")
        if self.correction_bias:
            params[CORRECTION_BIAS] = jnp.zeros((num_experts,), jnp.float32)
        return params

    def select(self, params, logits, k):
        return sigmoid_group_topk(
            logits, k, params.get(CORRECTION_BIAS), n_group=self.n_group, topk_group=self.topk_group,
            normalize=self.norm_topk_prob, routed_scaling_factor=self.routed_scaling_factor,
            group_mask_value=self.group_mask_value)

    def kernel_gating(self, params, k: int, num_experts: int) -> dict | None:
        """Sigmoid scores, selection on scores + bias with the same group limit as `sigmoid_group_topk`.

        None where the kernel could choose differently: an invalid k / grouping (`select` raises), groups of
        one expert (the kernel's group score needs two), a NaN `group_mask_value`, or a -inf one with k larger
        than the kept experts (the kernel's knocked-out experts would tie with the masked ones at -inf)."""
        if not 1 <= k <= num_experts or _overrides_select(self, DeepSeekV3Router):
            return None
        try:
            _check_groups(self.n_group, self.topk_group, num_experts)
        except ValueError:
            return None
        group_size = num_experts // self.n_group
        fill = float(self.group_mask_value)
        if self.n_group > 1 and (group_size < 2 or math.isnan(fill)
                                 or (fill == -math.inf and k > self.topk_group * group_size)):
            return None
        bias = params.get(CORRECTION_BIAS)
        return {"score_fn": "sigmoid", "correction_bias": None if bias is None else jax.lax.stop_gradient(bias),
                "n_group": self.n_group, "topk_group": self.topk_group, "group_fill_value": fill,
                "normalize": self.norm_topk_prob, "routed_scaling_factor": self.routed_scaling_factor}

    def choices_for_ids(self, params, logits, expert_ids):
        return sigmoid_choices(logits, expert_ids, normalize=self.norm_topk_prob,
                               routed_scaling_factor=self.routed_scaling_factor)


@dataclasses.dataclass(frozen=True)
class ExpertChoiceRouter(_LinearRouter):
    """Expert-choice routing: each expert takes its top-C tokens of `softmax(logits)` (see `expert_choice_plan`).

    `capacity_factor` is the average number of experts per token (default 2); `k` is unused. Balanced by
    construction: `aux_loss` defaults to 'none' (the z-loss is still reported)."""

    k: int = 1
    capacity_factor: float = 2.0
    aux_loss: str = "none"

    def __post_init__(self):
        super().__post_init__()
        if self.aux_loss not in ("none",):
            raise ValueError("expert_choice routing has no per-token choices to balance: aux_loss must be 'none'")

    def plan(self, params, logits, capacity_factor, *, alignment=1, valid=None, num_tokens_for_capacity=None
             ) -> tuple[RoutingPlan, jax.Array]:
        """(RoutingPlan with k = E, probs [S, E])."""
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        plan = expert_choice_plan(probs, capacity_factor, alignment=alignment, valid=valid,
                                  num_tokens_for_capacity=num_tokens_for_capacity)
        return plan, probs


ROUTER_TYPES: dict[str, Any] = {
    "softmax_topk": SoftmaxRouter,
    "mixtral": MixtralRouter,
    "qwen3_moe": Qwen3MoeRouter,
    "switch": SwitchRouter,
    "gpt_oss": GptOssRouter,
    "deepseek_v3": DeepSeekV3Router,
    "expert_choice": ExpertChoiceRouter,
}
GATE_TYPES.update(ROUTER_TYPES)
