"""`MoE`: the Flax NNX module, a thin stateful wrapper over `layer.moe_apply`.

The constructor takes Tutel's `moe_layer` arguments; calling it returns the output and records the aux loss
and routing statistics of the call (`layer.l_aux`, `layer.dispatch_count`, `layer.capacity`,
`layer.dropped_fraction`).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..checkpoint import (NUM_EXPERTS_KEY, params_to_state_dict, read_state_dict, save_torch_file,
                          state_dict_to_params)
from ..layer import MoEConfig, make_config, MoEAux, init_params, moe_apply
from ..core import update_correction_bias
from ..parallel import ExpertParallel, moe_apply_parallel, shard_params
from ..runtime import reconfigure_layer
from ..routing import as_gate, CORRECTION_BIAS
from ..validation import check_choice

__all__ = ["MoE", "RoutingStat", "RouterState"]


class RoutingStat(nnx.Variable):
    """Non-trainable record of the last call's routing (aux loss, counts, capacity, drops)."""


class RouterState(nnx.Variable):
    """Non-trainable router state kept in the parameter tree but updated outside the optimizer: DeepSeek-V3's
    `e_score_correction_bias` (aux-loss-free balancing). Not an `nnx.Param`, so `nnx.Optimizer(layer, tx,
    wrt=nnx.Param)` and `nnx.grad` (which differentiates `nnx.Param` by default) leave it alone; update it with
    `MoE.update_correction_bias(rate)` after each step."""


def _wrap_params(params):
    """nnx.Param for every leaf except router state (`RouterState`)."""

    def wrap(path, leaf):
        last = path[-1] if path else None
        return RouterState(leaf) if getattr(last, "key", None) == CORRECTION_BIAS else nnx.Param(leaf)
    return jax.tree_util.tree_map_with_path(wrap, params)


def _unbox(tree):
    return jax.tree.map(lambda v: v[...], tree, is_leaf=lambda v: isinstance(v, nnx.Variable))


def _last_call_stat(attr: str, doc: str) -> property:
    """A read-only property with the value of the routing statistic `attr` recorded by the last call."""
    return property(lambda self: getattr(self, attr).get_value(), doc=doc)


class MoE(nnx.Module):
    """Tutel's MoE layer as a Flax NNX module.

    Example::

        layer = MoE(gate_type={'type': 'top', 'k': 2}, model_dim=512,
                    experts={'type': 'ffn', 'count_per_node': 8, 'hidden_size_per_expert': 2048},
                    rngs=nnx.Rngs(0))
        y = layer(x)                      # x [..., 512] -> y [..., 512]
        loss = task_loss(y) + 0.01 * layer.l_aux

    Args mirror Tutel's `moe_layer`: gate_type (dict or list of dicts), model_dim, experts (dict with type,
    count_per_node / num_experts_per_device, hidden_size_per_expert, activation_fn, ...), scan_expert_func,
    result_func, group (None on one device, or an `ExpertParallel` placement: mesh + expert axes, for expert
    parallelism; E = count_per_node x expert-axis size), seeds (gate seed, expert seed, noise seed),
    a2a_ffn_overlap_degree, is_postscore, batch_prioritized_routing, normalize_gate, is_gshard_loss,
    parallel_type, use_2dh. Keyword-only: dtype (parameter/compute dtype), rngs (nnx.Rngs; used when no seeds),
    dropless_impl ('ragged', 'bucketed' or 'auto'; see `tutel_jax.experts._dropless`), kernel_backend (None / 'auto': the kernels
    of the platform the program is compiled for, plain XLA on CPUs; 'xla' | 'pallas' | 'interpret' | 'tpu' |
    'tpu_interpret': that implementation; see `tutel_jax.layer._execution`).
    Modern routers ('mixtral', 'qwen3_moe', 'deepseek_v3', 'gpt_oss', 'switch', 'expert_choice') and experts
    ('swiglu', 'gpt_oss', with `'shared': {...}` shared experts) plug in through gate_type / experts; a DeepSeek
    gate's `e_score_correction_bias` is a `RouterState` (not an `nnx.Param`): see `update_correction_bias`.
    The layer starts in training mode (gate noise on), like a torch module; `.eval()` turns it off.
    """

    def __init__(
        self,
        gate_type: Any,
        model_dim: int,
        experts: Any = None,
        scan_expert_func: Callable | None = None,
        result_func: Callable | None = None,
        group: Any = None,
        seeds: tuple | None = None,
        a2a_ffn_overlap_degree: int = 1,
        is_postscore: bool = True,
        batch_prioritized_routing: bool = False,
        normalize_gate: bool = True,
        is_gshard_loss: bool = True,
        parallel_type: str = "adaptive:1",
        use_2dh: bool = False,
        *,
        dtype: Any = jnp.float32,
        rngs: nnx.Rngs | None = None,
        dropless_impl: str = "ragged",
        kernel_backend: str | None = None,
        **kwargs: Any,
    ):
        if kwargs:
            raise ValueError(f"unknown argument(s) to MoE / moe_layer: {sorted(kwargs)}")
        if group is not None and not isinstance(group, ExpertParallel):
            raise ValueError("group must be None (one device) or a tutel_jax.parallel.ExpertParallel placement "
                             f"(mesh + expert axes), got {type(group).__name__}")
        self.placement: ExpertParallel | None = group
        self.config: MoEConfig = make_config(
            gate_type, model_dim, experts, world_size=1 if group is None else group.world_size,
            is_postscore=is_postscore,
            batch_prioritized_routing=batch_prioritized_routing, normalize_gate=normalize_gate,
            is_gshard_loss=is_gshard_loss, a2a_ffn_overlap_degree=a2a_ffn_overlap_degree,
            parallel_type=parallel_type, use_2dh=use_2dh, dtype=dtype, result_func=result_func,
            dropless_impl=dropless_impl, kernel_backend=kernel_backend)
        if seeds is not None:
            if len(seeds) < 2:
                raise ValueError(f"seeds must be (gate seed, expert seed[, noise seed]), got {seeds!r}")
            params = init_params(self.config, seeds=seeds)
            noise_seed = int(seeds[2]) if len(seeds) > 2 and seeds[2] is not None else 0
            rngs = nnx.Rngs(noise=noise_seed) if rngs is None else rngs
        else:
            rngs = nnx.Rngs(0) if rngs is None else rngs
            params = init_params(self.config, rngs.params())
        if scan_expert_func is not None:
            for name, value in params_to_state_dict(params["experts"], 0, "experts.").items():
                if not name.endswith(NUM_EXPERTS_KEY):
                    scan_expert_func(name, value)
        if group is not None:
            params = shard_params(params, group, self.config)
        self.params = nnx.data(_wrap_params(params))
        self.rngs = rngs
        self.deterministic = False
        num_experts = self.config.num_global_experts
        self._l_aux = RoutingStat(jnp.zeros((), jnp.float32))
        self._dispatch_count = RoutingStat(jnp.zeros((num_experts,), jnp.int32))
        self._capacity = RoutingStat(jnp.zeros((), jnp.int32))
        self._dropped_fraction = RoutingStat(jnp.zeros((), jnp.float32))

    # -- forward ---------------------------------------------------------------------------------------------
    def __call__(
        self,
        x: jax.Array,
        top_k: int | None = None,
        capacity_factor: float | None = None,
        gate_index: int = 0,
        a2a_ffn_overlap_degree: int | None = None,
        *,
        deterministic: bool | None = None,
        use_2dh: bool | None = None,
        valid: jax.Array | None = None,
        inequivalent_tokens: bool = False,
    ) -> jax.Array:
        """x [..., M] -> y [..., M_out] (same dtype); per-call overrides as in Tutel.

        With expert parallelism x is a global [B, ..., M] whose B splits over the token axes; `valid` [B, ...]
        marks real tokens when devices hold different counts, and `inequivalent_tokens` agrees the capacity.
        """
        deterministic = self.deterministic if deterministic is None else deterministic
        gate = self.config.gate(gate_index)
        rng = None
        if not deterministic and as_gate(gate).needs_rng:
            rng = self.rngs.noise() if "noise" in self.rngs else self.rngs()
        common = dict(top_k=top_k, capacity_factor=capacity_factor, gate_index=gate_index, rng=rng,
                      deterministic=deterministic, a2a_ffn_overlap_degree=a2a_ffn_overlap_degree)
        if self.placement is None:
            if valid is not None or inequivalent_tokens or use_2dh:
                raise ValueError("valid, inequivalent_tokens and use_2dh apply to expert parallelism (group=...)")
            y, aux = moe_apply(_unbox(self.params), x, self.config, **common)
        else:
            y, aux = moe_apply_parallel(_unbox(self.params), x, self.config, self.placement, use_2dh=use_2dh,
                                        valid=valid, inequivalent_tokens=inequivalent_tokens, **common)
        self._record(aux)
        return y

    def _record(self, aux: MoEAux) -> None:
        self._l_aux.set_value(aux.l_aux)
        self._dispatch_count.set_value(aux.dispatch_count)
        self._capacity.set_value(aux.capacity)
        self._dropped_fraction.set_value(aux.dropped_fraction)

    # -- routing statistics of the last call -----------------------------------------------------------------
    l_aux = _last_call_stat("_l_aux", "[] float32 load-balancing loss of the last call.")
    dispatch_count = _last_call_stat("_dispatch_count", "[E] int32 assignments per expert in the last call, "
                                                        "before dropping.")
    capacity = _last_call_stat("_capacity", "[] int32 capacity C used by the last call.")
    dropped_fraction = _last_call_stat("_dropped_fraction", "[] float32 fraction of assignments dropped in the "
                                                            "last call.")

    def update_correction_bias(self, rate: float, gate_index: int = 0, dispatch_count: jax.Array | None = None
                               ) -> None:
        """Aux-loss-free balancing: `bias += rate * sign(mean_load - load_e)` for the gate's
        `e_score_correction_bias`, with the last call's `dispatch_count` (global under expert parallelism) unless
        one is given (e.g. summed over micro-batches). Call it after the optimizer step, outside `nnx.grad`."""
        self.config.gate(gate_index)
        state = self.params["gates"][gate_index]
        if CORRECTION_BIAS not in state:
            raise ValueError(f"gate {gate_index} has no {CORRECTION_BIAS} (use a 'deepseek_v3' gate with "
                             "correction_bias=True)")
        counts = self.dispatch_count if dispatch_count is None else dispatch_count
        var = state[CORRECTION_BIAS]
        var.set_value(update_correction_bias(var.get_value(), counts, rate))

    # -- parameters ------------------------------------------------------------------------------------------
    @property
    def num_global_experts(self) -> int:
        return self.config.num_global_experts

    def param_tree(self) -> dict:
        """The parameters as a plain pytree of arrays (the functional core's `params`)."""
        return _unbox(self.params)

    def get_parameter_iterator(self, param_type: str) -> Iterator[tuple[str, jax.Array]]:
        """Tutel's iterator: ('gate', names under gates.*) or ('local_experts', names under experts.*)."""
        groups = {"gate": "gates", "local_experts": "experts"}
        check_choice(param_type, "param_type", sorted(groups))
        section = groups[param_type]
        state = params_to_state_dict({section: self.param_tree()[section]}, 0)
        for name, value in state.items():
            if name != NUM_EXPERTS_KEY:
                yield name, value

    def state_dict(self) -> dict[str, np.ndarray]:
        """Tutel's state dict (host NumPy arrays) with Tutel's keys."""
        return params_to_state_dict(self.param_tree(), self.config.num_global_experts)

    def load_state_dict(self, source: str | os.PathLike | Mapping[str, Any], prefix: str | None = None) -> None:
        """Loads a Tutel checkpoint: a `torch.save` file (read without torch) or a mapping of arrays.

        Raises ValueError naming the key for a wrong expert count, a wrong shape, a missing or an unknown key,
        and for files that are not valid checkpoints; the layer is unchanged when anything is wrong.
        """
        state = read_state_dict(source)
        params = state_dict_to_params(state, self.param_tree(), self.config.num_global_experts, prefix)
        if self.placement is not None:
            params = shard_params(params, self.placement, self.config)
        jax.tree.map(lambda var, value: var.set_value(jnp.asarray(value)), self.params, params,
                     is_leaf=lambda v: isinstance(v, nnx.Variable))

    def save_state_dict(self, path: str | os.PathLike) -> None:
        """Writes `state_dict()` as a file Tutel's `torch.load` reads (atomically)."""
        save_torch_file(path, self.state_dict())

    # -- runtime reconfiguration -----------------------------------------------------------------------------
    def reconfigure(self, runtime: Any, *, optimizer: Any = None, devices: Any = None) -> None:
        """Switches the layer, between two steps and without a restart, to a `tutel_jax.runtime._reconfigure.RuntimeConfig`:
        a new mesh / expert-axis size (E / W experts per device, or W / E devices per expert), adaptive_r,
        a2a_ffn_overlap_degree, use_2dh, and new gate defaults top_k / capacity_factor (None keeps them).

        Validates first: a bad request raises ValueError and changes nothing. Then the parameters (global shapes
        kept) and, when `optimizer` (an `nnx.Optimizer`) is given, its moments move to the new shardings with
        `jax.device_put`, bit for bit. `nnx.jit` caches one compiled step per configuration, so switching back
        does not recompile. See `tutel_jax.runtime._reconfigure.reconfigure_layer`.
        """
        reconfigure_layer(self, runtime, optimizer=optimizer, devices=devices)

    @staticmethod
    def global_expert_count(num_local_experts: int, group: ExpertParallel | None = None) -> int:
        """Tutel's helper: E from experts per device and the expert-parallel group size W."""
        world = 1 if group is None else group.world_size
        return num_local_experts * world if num_local_experts > 0 else max(world // -num_local_experts, 1)
