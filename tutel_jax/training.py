"""`MoETrainer`: a training-state helper that can switch layout, capacity and top-k between two steps.

Example::

    trainer = MoETrainer(config, loss_fn, optax.adam(1e-3), params, RuntimeConfig.ep(8))
    for batch in data:
        metrics = trainer.step(batch)                       # compiled once per (configuration, batch shape)
        if time_to_switch:
            trainer.switch(RuntimeConfig.ep(4, data=2, a2a_ffn_overlap_degree=2))   # reshard, no restart
    trainer.switch(RuntimeConfig.ep(8))                     # seen before: no recompilation
    trainer.cache_info()                                    # hits / misses / compiles / traces

The model is given as `loss_fn(params, batch, moe) -> loss` or `-> (loss, metrics dict)`, where `moe` is a
:class:`MoECall`: ``moe(layer_params, x) -> (y, aux)`` runs `moe_apply_parallel` with the current layout's
switches. Parameters are a pytree in which every MoE layer is a dict ``{'gates': ..., 'experts': ...}`` (from
`init_params`, possibly with 'shared_experts'); all MoE layers share `config`. Every other parameter is
replicated, and every batch leaf is split over the token shards along its leading axis.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from .checkpoint.orbax_io import restore_checkpoint, save_checkpoint
from .config import MoEConfig
from .layer import MoEAux
from .parallel.expert_parallel import moe_apply_parallel
from .reconfigure import (Layout, RuntimeConfig, batch_shardings, opt_state_shardings, params_shardings,
                          plan_layout, reshard)

__all__ = ["TrainState", "MoECall", "MoETrainer", "SwitchReport", "CacheInfo"]


@dataclasses.dataclass
class TrainState:
    """Everything a step updates. A pytree.

    Attributes:
      params: the model's parameter pytree (MoE layers as `init_params` dicts, expert leaves [E, ...]).
      opt_state: the optax state for `params`.
      step: [] int32, steps taken.
    """

    params: Any
    opt_state: Any
    step: jax.Array


jax.tree_util.register_dataclass(TrainState, data_fields=["params", "opt_state", "step"], meta_fields=[])


class MoECall:
    """What `loss_fn` gets as `moe`: the MoE layer function bound to the current layout and switches.

    ``moe(layer_params, x, *, gate_index=0, valid=None, inequivalent_tokens=False) -> (y, aux)`` with x a global
    [B, ..., M] (B split over the token shards) and y [B, ..., M_out], aux a `MoEAux` (see
    `moe_apply_parallel`). Each call gets its own gate-noise key (the step's key folded with the call index).
    """

    def __init__(self, layout: Layout, rng: jax.Array, deterministic: bool):
        self.layout = layout
        self._rng = rng
        self._deterministic = deterministic
        self._calls = 0

    @property
    def runtime(self) -> RuntimeConfig:
        return self.layout.runtime

    def __call__(self, layer_params: Any, x: jax.Array, *, gate_index: int = 0, valid: jax.Array | None = None,
                 inequivalent_tokens: bool = False) -> tuple[jax.Array, MoEAux]:
        rng = jax.random.fold_in(self._rng, self._calls)
        self._calls += 1
        return moe_apply_parallel(layer_params, x, self.layout.config, self.layout.placement, gate_index=gate_index,
                                  rng=rng, deterministic=self._deterministic, valid=valid,
                                  inequivalent_tokens=inequivalent_tokens, **self.layout.moe_kwargs())


@dataclasses.dataclass(frozen=True)
class SwitchReport:
    """What `MoETrainer.switch` did.

    Attributes:
      previous, current: the resolved runtime configs before and after.
      reshard_s: seconds spent moving params + optimizer state (0 when nothing moved).
      compile_s: seconds spent compiling the step for the new configuration (0 when cached or not precompiled).
      cached: whether a compiled step for the new configuration (and the last batch shape) was already cached.
    """

    previous: RuntimeConfig
    current: RuntimeConfig
    reshard_s: float
    compile_s: float
    cached: bool


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    """Compiled-step cache statistics: `hits` / `misses` of `step` and `compile` look-ups, `compiles` (= misses),
    `traces` (times the step function body was traced, counted by a Python side effect), `entries` (cached
    executables) and `configs` (the distinct runtime configs compiled, in first-use order)."""

    hits: int
    misses: int
    compiles: int
    traces: int
    entries: int
    configs: tuple[RuntimeConfig, ...]


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x.shape) if hasattr(x, "shape") else tuple(np.shape(x))


def _dtype(x: Any) -> Any:
    return x.dtype if hasattr(x, "dtype") else jnp.result_type(x)


def _signature(batch: Any) -> tuple:
    """(treedef, ((shape, dtype name), ...)): what a compiled step is specialised to besides the layout."""
    leaves, treedef = jax.tree.flatten(batch)
    return treedef, tuple((_shape(x), str(_dtype(x))) for x in leaves)


class MoETrainer:
    """Holds a TrainState on the devices of a layout, steps it, and switches layout / switches in between.

    Args:
      config: the MoE layers' MoEConfig (any world size; E, gates and experts are what matter).
      loss_fn: ``loss_fn(params, batch, moe) -> loss`` or ``-> (loss, metrics)``; loss a float32 scalar, metrics a
        dict of arrays (returned replicated by `step`).
      optimizer: an optax GradientTransformation.
      params: the initial parameter pytree (global arrays; expert leaves [E, ...]).
      runtime: the initial RuntimeConfig.
      devices: devices the meshes are built from (default `jax.devices()`).
      seed: gate-noise seed; step i uses fold_in(key(seed), i), so the noise depends only on the step.
      deterministic: no gate noise (Tutel's eval mode); default False (noise when a gate has gate_noise > 0).
      donate: donate the state to each step (it is updated in place; arrays of an older `state` are deleted).
    """

    def __init__(self, config: MoEConfig, loss_fn: Callable[..., Any], optimizer: Any, params: Any,
                 runtime: RuntimeConfig, *, devices: Any = None, seed: int = 0, deterministic: bool = False,
                 donate: bool = True):
        self.base_config = config
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.devices = list(jax.devices() if devices is None else devices)
        self.seed = int(seed)
        self.deterministic = bool(deterministic)
        self.donate = bool(donate)
        self._layout = plan_layout(config, runtime, self.devices)
        self._cache: dict[tuple, Any] = {}
        self._configs: list[RuntimeConfig] = []
        self._hits = self._misses = self._traces = 0
        self._last_signature: tuple | None = None
        params = reshard(params, params_shardings(params, self._layout))
        opt_state = optimizer.init(params)  # eager: moments follow the parameters' shardings
        self._state = TrainState(params, opt_state, jnp.zeros((), jnp.int32))
        self._state = reshard(self._state, self.state_shardings(self._layout, self._state))

    # -- state ---------------------------------------------------------------------------------------------
    @property
    def state(self) -> TrainState:
        """The current TrainState (with `donate`, valid until the next `step`)."""
        return self._state

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def runtime(self) -> RuntimeConfig:
        """The current runtime config (adaptive_r resolved)."""
        return self._layout.runtime

    def state_shardings(self, layout: Layout | None = None, state: TrainState | None = None) -> TrainState:
        """The shardings of the state on `layout` (default the current one), as a TrainState of shardings."""
        layout = self._layout if layout is None else layout
        state = self._state if state is None else state
        param_sh = params_shardings(state.params, layout)
        return TrainState(param_sh, opt_state_shardings(self.optimizer, state.opt_state, param_sh, layout),
                          layout.replicated())

    def set_state(self, state: TrainState) -> None:
        """Replaces the state (e.g. a reset), placing it on the current layout."""
        if not isinstance(state, TrainState):
            raise ValueError(f"expected a TrainState, got {type(state).__name__}")
        self._state = reshard(state, self.state_shardings(state=state))

    # -- switching -----------------------------------------------------------------------------------------
    def plan(self, runtime: RuntimeConfig) -> Layout:
        """Validates `runtime` for this model (and the last batch shape) without changing anything."""
        layout = plan_layout(self.base_config, runtime, self.devices)
        if self._last_signature is not None:
            shards = layout.placement.num_token_shards
            for shape, _ in self._last_signature[1]:
                if shape and shape[0] % shards:
                    raise ValueError(f"cannot switch to [{runtime.describe()}]: the batch's leading dimension "
                                     f"{shape[0]} is not divisible by its {shards} token shards")
        return layout

    def switch(self, runtime: RuntimeConfig, *, precompile: bool = False, donate: bool = False) -> SwitchReport:
        """Switches to `runtime` between two steps: validates, reshards params + optimizer state, selects the
        compiled step for the new configuration.

        A bad request (see `plan_layout`) raises ValueError before anything moves: the running state and layout
        are untouched. Resharding is `jax.device_put` to the new layout's shardings: global shapes are kept and
        values are copied bit for bit. With `precompile` (and a batch seen before) the step for the new
        configuration is compiled now instead of at the next `step`. With `donate` the old buffers may be reused.
        """
        layout = self.plan(runtime)
        previous = self._layout.runtime
        start = time.perf_counter()
        moved = layout != self._layout
        if moved:
            self._state = reshard(self._state, self.state_shardings(layout), donate=donate)
        reshard_s = time.perf_counter() - start if moved else 0.0
        self._layout = layout
        cached = self._last_signature is not None and (layout.runtime, self._last_signature) in self._cache
        compile_s = 0.0
        if precompile and self._last_signature is not None and not cached:
            compile_s = self._compile_for(self._last_signature, self._abstract_batch(self._last_signature))
        return SwitchReport(previous=previous, current=layout.runtime, reshard_s=reshard_s, compile_s=compile_s,
                            cached=cached)

    # -- stepping ------------------------------------------------------------------------------------------
    def _train_step(self, layout: Layout) -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
        import optax
        loss_fn, optimizer, seed, deterministic = self.loss_fn, self.optimizer, self.seed, self.deterministic

        def train_step(state: TrainState, batch: Any) -> tuple[TrainState, dict]:
            self._traces += 1  # Python side effect: runs once per trace
            moe = MoECall(layout, jax.random.fold_in(jax.random.key(seed), state.step), deterministic)

            def objective(params):
                out = loss_fn(params, batch, moe)
                loss, metrics = out if isinstance(out, tuple) else (out, {})
                return loss, metrics

            (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            return TrainState(params, opt_state, state.step + 1), {"loss": loss, **dict(metrics)}

        return train_step

    def _abstract_batch(self, signature: tuple) -> Any:
        treedef, leaves = signature
        sh = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in leaves]
        return jax.tree.unflatten(treedef, sh)

    def _compile_for(self, signature: tuple, batch: Any) -> float:
        """Compiles the step for the current layout and `batch`'s signature; returns the seconds it took."""
        layout = self._layout
        start = time.perf_counter()
        state_sh = self.state_shardings(layout)
        batch_sh = batch_shardings(batch, layout)
        jitted = jax.jit(self._train_step(layout), in_shardings=(state_sh, batch_sh),
                         out_shardings=(state_sh, layout.replicated()), donate_argnums=(0,) if self.donate else ())
        abstract_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                      self._state, state_sh)
        abstract_batch = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(_shape(x), _dtype(x), sharding=s),
                                      batch, batch_sh)
        compiled = jitted.lower(abstract_state, abstract_batch).compile()
        self._misses += 1
        self._cache[(layout.runtime, signature)] = compiled
        if layout.runtime not in self._configs:
            self._configs.append(layout.runtime)
        return time.perf_counter() - start

    def compile(self, batch: Any) -> float:
        """Makes sure the step for the current configuration and `batch`'s shapes is compiled; returns the
        seconds spent compiling (0.0 when it was cached)."""
        signature = _signature(batch)
        self._check_batch(signature)
        if (self._layout.runtime, signature) in self._cache:
            self._hits += 1
            return 0.0
        return self._compile_for(signature, batch)

    def _check_batch(self, signature: tuple) -> None:
        shards = self._layout.placement.num_token_shards
        for shape, _ in signature[1]:
            if shape and shape[0] % shards:
                raise ValueError(f"batch leaves need a leading dimension divisible by the {shards} token shards, "
                                 f"got shape {shape}")

    def step(self, batch: Any) -> dict[str, jax.Array]:
        """One training step on `batch` (pytree of global arrays [B, ...]); returns the metrics ('loss', ...)."""
        signature = _signature(batch)
        key = (self._layout.runtime, signature)
        compiled = self._cache.get(key)
        if compiled is None:
            self._check_batch(signature)
            self._compile_for(signature, batch)
            compiled = self._cache[key]
        else:
            self._hits += 1
        self._last_signature = signature
        batch = jax.device_put(batch, batch_shardings(batch, self._layout))
        self._state, metrics = compiled(self._state, batch)
        return metrics

    # -- cache statistics ------------------------------------------------------------------------------------
    @property
    def compile_count(self) -> int:
        """Steps compiled so far (one per distinct (runtime config, batch shapes))."""
        return self._misses

    def cache_info(self) -> CacheInfo:
        return CacheInfo(hits=self._hits, misses=self._misses, compiles=self._misses, traces=self._traces,
                         entries=len(self._cache), configs=tuple(self._configs))

    # -- checkpoints -----------------------------------------------------------------------------------------
    def save(self, directory: Any, *, max_to_keep: int | None = None) -> Any:
        """Saves the state with Orbax as step `state.step` (global arrays: restorable onto any layout)."""
        s = self._state
        return save_checkpoint(directory, {"params": s.params, "opt_state": s.opt_state, "step": s.step},
                               int(s.step), max_to_keep=max_to_keep)

    def restore(self, directory: Any, step: int | None = None) -> int:
        """Restores a state saved by `save` (from any layout) onto the current layout; returns its step."""
        sh = self.state_shardings()
        restored = restore_checkpoint(directory, {"params": sh.params, "opt_state": sh.opt_state, "step": sh.step},
                                      step)
        self._state = TrainState(restored["params"], restored["opt_state"], restored["step"])
        return int(self._state.step)
