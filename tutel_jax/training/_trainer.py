"""`MoETrainer`: a training-state helper that can switch layout, capacity and top-k between two steps.

Example::

    trainer = MoETrainer(config, loss_fn, optax.adam(1e-3), params, RuntimeConfig.ep(8))
    for batch in data:
        metrics = trainer.step(batch)                       # compiled once per (configuration, batch shape)
        if time_to_switch:
            trainer.switch(RuntimeConfig.ep(4, data=2, a2a_ffn_overlap_degree=2))   # reshard, no restart
    trainer.switch(RuntimeConfig.ep(8))                     # seen before: no recompilation
    trainer.cache_info()                                    # hits / misses / compiles / traces
    trainer.evaluate(val_batch)                             # loss + metrics, no update, no gate noise

Adaptive runtime (`autotune`): time candidate configurations on live training steps and keep the fastest::

    candidates = [RuntimeConfig.ep(8), RuntimeConfig.ep(8, a2a_ffn_overlap_degree=2), RuntimeConfig.ep_2dh(2, 4)]
    report = trainer.autotune(candidates, batches=data)    # real training steps; then runs the fastest
    for batch in data:
        metrics = trainer.step(batch)
        if trainer.observe_routing(metrics):                # load ratio left the tuned band `patience` times
            trainer.autotune(candidates, batches=data)      # tune again (compiled steps are reused)

The model is given as `loss_fn(params, batch, moe) -> loss` or `-> (loss, metrics dict)`, where `moe` is a
:class:`MoECall`: ``moe(layer_params, x) -> (y, aux)`` runs `moe_apply_parallel` with the current layout's
switches. Parameters are a pytree in which every MoE layer is a dict ``{'gates': ..., 'experts': ...}`` (from
`init_params`, possibly with 'shared_experts'); all MoE layers share `config`. Every other parameter is
replicated, and every batch leaf is split over the token shards along its leading axis.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..layer import MoEConfig, MoEAux
from ..parallel import moe_apply_parallel
from ..runtime import (Autotuner, Candidate, Decision, DecisionLog, Layout, Measurement, RuntimeConfig, Sample,
                       batch_shardings, metrics_load_ratio, opt_state_shardings, params_shardings, plan_layout,
                       reshard)
from ..validation import check_int
from ._orbax_io import restore_checkpoint, save_checkpoint

__all__ = ["TrainState", "MoECall", "MoETrainer", "SwitchReport", "CacheInfo", "AutotuneReport"]


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


@dataclasses.dataclass(frozen=True)
class AutotuneReport:
    """What `MoETrainer.autotune` did: the tuner's `autotune.Decision` plus what the trainer adds.

    Attributes:
      chosen: the runtime config now running (adaptive_r resolved).
      decision: the tuner's decision (chosen / default measurement, every measurement, skipped, band, reason).
      steps: training steps taken while tuning (warmup + measured, over all candidates).
      compile_s: seconds spent compiling while tuning (not part of any step time).
    Properties (from the decision): label (the chosen candidate's), default (the first valid candidate's
    runtime config: what runs without tuning), speedup (the default's median step time / the chosen one's,
    >= 1), measurements (`autotune.Measurement` per valid candidate), skipped ((label, reason) per invalid
    candidate, strict=False), band (the armed capacity band of the load ratio, or None), reason.
    """

    chosen: RuntimeConfig
    decision: Decision
    steps: int
    compile_s: float

    @property
    def label(self) -> str:
        return self.decision.chosen.candidate.label

    @property
    def default(self) -> RuntimeConfig:
        return self.decision.default.candidate.runtime

    @property
    def speedup(self) -> float:
        return self.decision.speedup

    @property
    def measurements(self) -> tuple[Measurement, ...]:
        return self.decision.measurements

    @property
    def skipped(self) -> tuple[tuple[str, str], ...]:
        return tuple((c.label, why) for c, why in self.decision.skipped)

    @property
    def band(self) -> tuple[float, float] | None:
        return self.decision.band

    @property
    def reason(self) -> str:
        return self.decision.reason

    def as_dict(self) -> dict[str, Any]:
        return {"chosen": self.chosen.describe(), "label": self.label, "default": self.default.describe(),
                "speedup": self.speedup, "measurements": [m.as_dict() for m in self.measurements],
                "skipped": [list(s) for s in self.skipped], "band": None if self.band is None else list(self.band),
                "steps": self.steps, "compile_s": self.compile_s, "reason": self.reason}


def _batch_source(batches: Any) -> Callable[[], Any]:
    """A zero-argument callable giving the next batch, from a callable, an iterator or an iterable."""
    if callable(batches):
        return batches
    try:
        iterator = iter(batches)
    except TypeError:
        raise ValueError("batches must be an iterator, an iterable or a zero-argument callable returning batches, "
                         f"got {type(batches).__name__}") from None
    taken = [0]

    def next_batch():
        try:
            batch = next(iterator)
        except StopIteration:
            raise ValueError(f"autotune: `batches` ran out after {taken[0]} batches") from None
        taken[0] += 1
        return batch

    return next_batch


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
        # evaluate's executables: their own cache and statistics (see `eval_cache_info`)
        self._eval_cache: dict[tuple, Any] = {}
        self._eval_configs: list[RuntimeConfig] = []
        self._eval_hits = self._eval_misses = self._eval_traces = 0
        self.autotune_log = DecisionLog()  # every autotune decision of this trainer, in order
        self._autotuner: Autotuner | None = None
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

    def fork(self) -> "MoETrainer":
        """A second trainer of the same model, on the same layout, starting from a copy of the current state and
        sharing this one's compiled steps and evaluations (the caches themselves, so neither compiles what the
        other has). Stepping or switching one leaves the other alone; the cache statistics are copied at the fork
        and counted apart from then on; the fork has an empty autotune log. E.g. to time configurations side by
        side without compiling them twice."""
        other = copy.copy(self)
        other._configs, other._eval_configs = list(self._configs), list(self._eval_configs)
        other.autotune_log, other._autotuner = DecisionLog(), None
        # through the host: new buffers, so that donating one trainer's state never deletes the other's
        other._state = reshard(jax.tree.map(np.asarray, self._state), self.state_shardings())
        return other

    # -- switching -----------------------------------------------------------------------------------------
    def plan(self, runtime: RuntimeConfig) -> Layout:
        """Validates `runtime` for this model (and the last batch shape) without changing anything."""
        return self._plan_for(runtime, self._last_signature)

    def _plan_for(self, runtime: RuntimeConfig, signature: tuple | None) -> Layout:
        layout = plan_layout(self.base_config, runtime, self.devices)
        if signature is not None:
            shards = layout.placement.num_token_shards
            for shape, _ in signature[1]:
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

    # -- evaluation ------------------------------------------------------------------------------------------
    def _eval_step(self, layout: Layout) -> Callable[[Any, jax.Array, Any], dict]:
        loss_fn, seed = self.loss_fn, self.seed

        def eval_step(params: Any, step: jax.Array, batch: Any) -> dict:
            self._eval_traces += 1  # Python side effect: runs once per trace
            # deterministic: no gate noise or jitter, whatever the trainer's `deterministic` (Tutel's eval mode)
            moe = MoECall(layout, jax.random.fold_in(jax.random.key(seed), step), True)
            out = loss_fn(params, batch, moe)
            loss, metrics = out if isinstance(out, tuple) else (out, {})
            return {"loss": loss, **dict(metrics)}

        return eval_step

    def _compile_eval(self, signature: tuple, batch: Any) -> Any:
        layout = self._layout
        param_sh = params_shardings(self._state.params, layout)
        batch_sh = batch_shardings(batch, layout)
        jitted = jax.jit(self._eval_step(layout), in_shardings=(param_sh, layout.replicated(), batch_sh),
                         out_shardings=layout.replicated())  # no donation: the state is only read
        abstract_params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                       self._state.params, param_sh)
        abstract_step = jax.ShapeDtypeStruct((), jnp.int32, sharding=layout.replicated())
        abstract_batch = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(_shape(x), _dtype(x), sharding=s),
                                      batch, batch_sh)
        compiled = jitted.lower(abstract_params, abstract_step, abstract_batch).compile()
        self._eval_misses += 1
        self._eval_cache[(layout.runtime, signature)] = compiled
        if layout.runtime not in self._eval_configs:
            self._eval_configs.append(layout.runtime)
        return compiled

    def evaluate(self, batch: Any) -> dict[str, jax.Array]:
        """`loss_fn` on `batch` (pytree of global arrays [B, ...]) with the current params and layout: no
        gradients, no update, no gate noise (deterministic). Returns the metrics ({'loss': [], **loss_fn's}),
        replicated. The state is not changed.

        Compiled once per (runtime config, batch signature) in a cache of its own, so `cache_info` (the training
        step's) is unaffected; see `eval_cache_info`. Raises ValueError for a batch whose leading dimension is
        not divisible by the token shards."""
        signature = _signature(batch)
        compiled = self._eval_cache.get((self._layout.runtime, signature))
        if compiled is None:
            self._check_batch(signature)
            compiled = self._compile_eval(signature, batch)
        else:
            self._eval_hits += 1
        batch = jax.device_put(batch, batch_shardings(batch, self._layout))
        return compiled(self._state.params, self._state.step, batch)

    # -- adaptive runtime --------------------------------------------------------------------------------------
    def _follows_routing(self, candidate: Candidate) -> bool:
        """Whether the candidate's capacity follows the routing: capacity_factor <= 0 (its own, else a gate's)."""
        cf = candidate.runtime.capacity_factor
        if cf is not None:
            return cf <= 0
        return any(getattr(g, "capacity_factor", 1.0) <= 0 for g in self.base_config.gates)

    def autotune(self, candidates: Sequence[RuntimeConfig | Candidate], *, batches: Any, warmup: int = 1,
                 measure: int = 3, clock: Callable[[], float] = time.perf_counter, strict: bool = True,
                 retune_tolerance: float = 0.25, patience: int = 3,
                 on_step: Callable[[dict], Any] | None = None) -> AutotuneReport:
        """Times every candidate on live training steps and switches to the fastest (median step time).

        First one batch is taken (for its shapes) and every candidate is validated (`plan_layout`, and the
        batch's leading dimension divisible by its token shards): with `strict` any invalid one raises a
        ValueError listing them all before anything is measured; otherwise they are logged as 'skip-invalid'.
        Then, per valid candidate in order: `switch`, compile for the live batch (timed with `clock`, reported
        as compile_s, never part of a step time; cached, so a second autotune compiles nothing), `warmup`
        untimed steps, `measure` timed steps (`clock` around `step` + `jax.block_until_ready`). Every step is a
        real training step on the next batch of `batches`: the model is updated. Ties go to the earlier
        candidate; the first valid one is the default the speedup is relative to.

        Re-evaluation: the tuner is kept. Call `observe_routing(metrics)` after each `step`; when it returns
        True (the load ratio `metrics['moe_load_ratio']`, see `autotune.load_ratio`, was outside the tuned band
        for `patience` consecutive steps), call `autotune` again. A config with a fixed capacity
        (capacity_factor > 0) never asks to retune.

        Args:
          candidates: RuntimeConfig or `autotune.Candidate` objects (a Candidate carries a label).
          batches: an iterator, an iterable (consumed in order) or a zero-argument callable giving batches.
          warmup: untimed steps per candidate (>= 0). measure: timed steps per candidate (>= 1).
          clock: seconds (injectable for tests). strict: see above.
          retune_tolerance, patience: the capacity band's relative width and the out-of-band steps before
            a retune (see `autotune.Autotuner`).
          on_step: optional callback given each tuning step's metrics (outside the timed region).

        Returns:
          An AutotuneReport; `autotune_log` holds the decisions (a DecisionLog over all autotune calls).
        """
        check_int(warmup, "autotune: warmup", minimum=0)
        check_int(measure, "autotune: measure", minimum=1)
        tuner = Autotuner(clock=clock, tolerance=retune_tolerance, patience=patience, log=self.autotune_log)
        next_batch = _batch_source(batches)
        pending = [next_batch()]
        signature = _signature(pending[0])
        steps = [0]
        compile_total = [0.0]

        def run(candidate: Candidate) -> Sample:
            self.switch(candidate.runtime)
            times, ratios, compile_s = [], [], 0.0
            for i in range(warmup + measure):
                batch = pending.pop() if pending else next_batch()
                sig = _signature(batch)
                if (self._layout.runtime, sig) not in self._cache:
                    self._check_batch(sig)
                    start = clock()
                    self._compile_for(sig, batch)
                    compile_s += clock() - start
                start = clock()
                metrics = self.step(batch)
                jax.block_until_ready((metrics, self._state))
                elapsed = clock() - start
                steps[0] += 1
                if i >= warmup:
                    times.append(elapsed)
                    ratio = metrics_load_ratio(metrics)
                    if ratio is not None:
                        ratios.append(ratio)
                if on_step is not None:
                    on_step(metrics)
            compile_total[0] += compile_s
            return Sample(tuple(times), compile_s, tuple(ratios))

        decision = tuner.tune(candidates, run, check=lambda c: self._plan_for(c.runtime, signature), strict=strict,
                              follows_routing=self._follows_routing)
        self.switch(decision.chosen.candidate.runtime)
        self._autotuner = tuner
        return AutotuneReport(chosen=self.runtime, decision=decision, steps=steps[0], compile_s=compile_total[0])

    def observe_routing(self, metrics: dict) -> bool:
        """Feeds a step's metrics to the last autotune's capacity band; True when a retune is due (then call
        `autotune` again). False before any autotune and for a fixed capacity. See `autotune.Autotuner.observe`
        (ValueError when a band is armed but metrics lack 'moe_load_ratio')."""
        return False if self._autotuner is None else self._autotuner.observe(metrics)

    # -- cache statistics ------------------------------------------------------------------------------------
    @property
    def compile_count(self) -> int:
        """Steps compiled so far (one per distinct (runtime config, batch shapes))."""
        return self._misses

    def cache_info(self) -> CacheInfo:
        """The training step's cache (`step`, `compile`, `switch(precompile=True)`); evaluate has its own."""
        return CacheInfo(hits=self._hits, misses=self._misses, compiles=self._misses, traces=self._traces,
                         entries=len(self._cache), configs=tuple(self._configs))

    def eval_cache_info(self) -> CacheInfo:
        """`evaluate`'s cache, counted like `cache_info`: hits, misses (= compiles), traces, entries, configs."""
        return CacheInfo(hits=self._eval_hits, misses=self._eval_misses, compiles=self._eval_misses,
                         traces=self._eval_traces, entries=len(self._eval_cache), configs=tuple(self._eval_configs))

    # -- checkpoints -----------------------------------------------------------------------------------------
    def save(self, directory: Any, *, max_to_keep: int | None = None) -> Any:
        """Saves the state with Orbax as step `state.step` (global arrays: restorable onto any layout)."""
        s = self._state
        return save_checkpoint(directory, {"params": s.params, "opt_state": s.opt_state, "step": s.step},
                               int(s.step), max_to_keep=max_to_keep)

    def restore(self, directory: Any, step: int | None = None) -> int:
        """Restores a state saved by `save` (from any layout) onto the current layout; returns its step.

        The stored arrays must have this trainer's global shapes: a checkpoint of another model shape is a
        ValueError naming the array and the directory, and nothing is restored."""
        sh = self.state_shardings()
        s = self._state
        # the current shapes with the current layout's shardings: restore_checkpoint checks them against the store
        want = lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)  # noqa: E731
        target = {"params": jax.tree.map(want, s.params, sh.params),
                  "opt_state": jax.tree.map(want, s.opt_state, sh.opt_state), "step": want(s.step, sh.step)}
        restored = restore_checkpoint(directory, target, step)
        self._state = TrainState(restored["params"], restored["opt_state"], restored["step"])
        return int(self._state.step)
