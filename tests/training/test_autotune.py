"""The adaptive runtime (`tutel_jax.runtime._autotune`, `MoETrainer.autotune`), driven by fake clocks so that every
decision is deterministic: the pure Autotuner with a fake `measure`, then a real MoETrainer on 8 fake CPU devices
whose clock advances by a configured cost per step and per compile of the running configuration.

Fake costs are binary fractions (multiples of 2**-10 s), so the clock's sums and differences are exact and the
measured times are compared with ==."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from support import reference_np as ref
from tutel_jax import init_params, make_config, moe_apply
from tutel_jax.runtime._autotune import (LOAD_RATIO_KEY, Autotuner, Candidate, Sample, load_ratio, metrics_load_ratio,
                                        short_name)
from tutel_jax.layer import MoEAux
from tutel_jax.runtime._reconfigure import RuntimeConfig, plan_layout
from tutel_jax.training import MoETrainer

MS = 2.0 ** -10  # one fake "millisecond", exact in binary

EP8 = RuntimeConfig.ep(8)
EP8_D2 = RuntimeConfig.ep(8, a2a_ffn_overlap_degree=2)
EP4_DP2 = RuntimeConfig.ep(4, data=2)
EP2_DP4 = RuntimeConfig.ep(2, data=4)


class Ticks:
    """A clock that ticks by one per call (the log's time stamps)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1.0
        return self.now


def fake_measure(table: dict[str, Sample], calls: list[str]):
    def measure(candidate: Candidate) -> Sample:
        calls.append(candidate.label)
        return table[candidate.label]
    return measure


# -- the pure decision logic -----------------------------------------------------------------------------------
def test_short_names():
    assert short_name(EP8) == "ep8"
    assert short_name(EP8_D2) == "ep8 d=2"
    assert short_name(EP4_DP2) == "data2 x ep4"
    assert short_name(RuntimeConfig.ep_2dh(2, 4)) == "2dh 2x4"
    assert short_name(RuntimeConfig.ep(8, adaptive_r=0, dropless_impl="loop", capacity_factor=0.0)) == \
        "ep8 r=0 cf=0 dropless=loop"
    assert Candidate(EP8, "flat").label == "flat" and Candidate(EP8).label == "ep8"


def test_picks_the_fastest_median_and_logs_every_measurement_and_why():
    table = {"ep8": Sample((10 * MS, 12 * MS, 11 * MS)),            # median 11
             "ep8 d=2": Sample((6 * MS, 40 * MS, 7 * MS)),          # median 7 (mean 17.7: the median decides)
             "data2 x ep4": Sample((9 * MS, 9 * MS, 9 * MS))}
    calls: list[str] = []
    tuner = Autotuner(clock=Ticks())
    decision = tuner.tune([EP8, EP8_D2, EP4_DP2], fake_measure(table, calls), follows_routing=lambda c: False)
    assert calls == ["ep8", "ep8 d=2", "data2 x ep4"]
    assert decision.chosen.candidate.runtime == EP8_D2 and decision.default.candidate.runtime == EP8
    assert decision.chosen.median_s == 7 * MS and decision.speedup == 11 / 7
    entries = tuner.log.entries
    assert [e.event for e in entries] == ["measure", "measure", "measure", "choose"]
    assert [e.time for e in entries] == [1.0, 2.0, 3.0, 4.0]
    assert [e.config for e in entries] == [EP8.describe(), EP8_D2.describe(), EP4_DP2.describe(), EP8_D2.describe()]
    assert [(e.median_s, e.runs) for e in entries[:3]] == [(11 * MS, 3), (7 * MS, 3), (9 * MS, 3)]
    assert entries[1].step_times_s == (6 * MS, 40 * MS, 7 * MS)
    assert entries[3].reason.startswith(f"chose ep8 d=2: {7 * MS * 1e3:.3g} ms/step, 1.57x faster than the "
                                        f"default ep8 ({11 * MS * 1e3:.3g} ms/step)")
    assert "fixed capacity" in entries[3].reason and decision.band is None


def test_ties_go_to_the_earlier_candidate():
    same = Sample((5 * MS,) * 3)
    decision = Autotuner().tune([EP8, EP8_D2], fake_measure({"ep8": same, "ep8 d=2": same}, []))
    assert decision.chosen is decision.default and decision.chosen.candidate.runtime == EP8
    assert decision.reason.startswith(f"kept the default ep8: {5 * MS * 1e3:.3g} ms/step, the fastest of 2 "
                                      "(next: ep8 d=2, 1.00x slower)")
    faster = Sample((3 * MS,) * 3)  # a tie between two later candidates: the earlier of them
    decision = Autotuner().tune([EP8, EP8_D2, EP4_DP2],
                                fake_measure({"ep8": same, "ep8 d=2": faster, "data2 x ep4": faster}, []))
    assert decision.chosen.candidate.runtime == EP8_D2


def test_compile_time_is_reported_but_never_counted():
    table = {"ep8": Sample((10 * MS,) * 3, compile_s=0.5), "ep8 d=2": Sample((4 * MS,) * 3, compile_s=30.0)}
    tuner = Autotuner()
    decision = tuner.tune([EP8, EP8_D2], fake_measure(table, []))
    assert decision.chosen.candidate.runtime == EP8_D2  # slow compile, fast steps: it wins
    assert [m.compile_s for m in decision.measurements] == [0.5, 30.0]
    assert [e.compile_s for e in tuner.log.events("measure")] == [0.5, 30.0]
    assert tuner.log.events("choose")[0].median_s == 4 * MS
    assert "compile 30 s, not counted" in tuner.log.events("measure")[1].reason


def _check(bad: dict[str, str]):
    def check(candidate: Candidate) -> None:
        if candidate.label in bad:
            raise ValueError(bad[candidate.label])
    return check


def test_invalid_candidates_are_refused_together_before_anything_is_measured():
    calls: list[str] = []
    tuner = Autotuner()
    with pytest.raises(ValueError, match=r"2 of 4 candidates are invalid: \[ep8 d=2\] no overlap today; "
                                         r"\[data4 x ep2\] never built") as info:
        tuner.tune([EP8, EP8_D2, EP4_DP2, EP2_DP4], fake_measure({}, calls),
                   check=_check({"ep8 d=2": "no overlap today", "data4 x ep2": "never built"}))
    assert "data2 x ep4" not in str(info.value)
    assert calls == [] and len(tuner.log) == 0


def test_non_strict_skips_and_logs_invalid_candidates_first():
    calls: list[str] = []
    tuner = Autotuner(clock=Ticks())
    table = {"ep8": Sample((9 * MS,)), "data2 x ep4": Sample((8 * MS,))}
    decision = tuner.tune([EP8, EP8_D2, EP4_DP2], fake_measure(table, calls), strict=False,
                          check=_check({"ep8 d=2": "no overlap today"}))
    assert calls == ["ep8", "data2 x ep4"]
    assert [e.event for e in tuner.log] == ["skip-invalid", "measure", "measure", "choose"]
    skip = tuner.log.entries[0]
    assert skip.label == "ep8 d=2" and skip.reason == "skipped ep8 d=2: no overlap today" and skip.median_s is None
    assert [(c.runtime, why) for c, why in decision.skipped] == [(EP8_D2, "no overlap today")]
    assert decision.chosen.candidate.runtime == EP4_DP2


def test_no_candidates_or_none_valid_is_an_error():
    with pytest.raises(ValueError, match="the candidate list is empty"):
        Autotuner().tune([], fake_measure({}, []))
    calls: list[str] = []
    with pytest.raises(ValueError, match=r"none of the 2 candidates is valid: \[ep8\] a; \[ep8 d=2\] b"):
        Autotuner().tune([EP8, EP8_D2], fake_measure({}, calls), strict=False, check=_check({"ep8": "a", "ep8 d=2": "b"}))
    assert calls == []
    with pytest.raises(ValueError, match="must be RuntimeConfig or Candidate"):
        Autotuner().tune(["ep8"], fake_measure({}, []))


def test_bad_tuner_settings_are_refused():
    with pytest.raises(ValueError, match="tolerance must be a finite number > 0"):
        Autotuner(tolerance=0.0)
    with pytest.raises(ValueError, match="patience must be an integer >= 1"):
        Autotuner(patience=0)


def _armed(ratios=(1.4, 1.5, 1.6), follows=True, patience=3) -> Autotuner:
    tuner = Autotuner(clock=Ticks(), patience=patience)
    tuner.tune([EP8], fake_measure({"ep8": Sample((MS,) * 3, load_ratios=ratios)}, []),
               follows_routing=lambda c: follows)
    return tuner


def test_band_retunes_only_after_patience_consecutive_out_of_band_steps():
    tuner = _armed()
    assert tuner.band == (1.5 / 1.25, 1.5 * 1.25)  # around the median ratio 1.5, tolerance 0.25
    assert "capacity band [1.2, 1.88] around load ratio 1.5" in tuner.log.events("choose")[0].reason
    low, high = tuner.band
    seen = [tuner.observe({LOAD_RATIO_KEY: r}) for r in (1.5, high, low, 2.5, 2.5, 1.5, 0.5, 3.0)]
    assert seen == [False] * 8  # bounds are inside; two outside, then back in: the count restarts
    assert tuner.observe({LOAD_RATIO_KEY: 2.0}) is True  # the third consecutive one outside
    retune = tuner.log.events("retune")
    assert len(retune) == 1 and retune[0].band == (low, high) and retune[0].load_ratio == 2.0
    assert retune[0].reason == "load ratio 2 outside the band [1.2, 1.88] for 3 consecutive steps"
    assert retune[0].config == EP8.describe()
    assert tuner.observe({LOAD_RATIO_KEY: 2.0}) is False  # the count starts again after a retune is reported
    assert tuner.observe({LOAD_RATIO_KEY: jnp.asarray([1.3, 2.0])}) is False  # per-layer ratios: their max
    assert tuner.observe({LOAD_RATIO_KEY: np.asarray([1.3, 2.0])}) is True
    with pytest.raises(ValueError, match="no 'moe_load_ratio'"):
        tuner.observe({"loss": 1.0})


def test_fixed_capacity_or_no_ratios_never_retunes():
    for tuner, why in ((_armed(follows=False), "fixed capacity (capacity_factor > 0): no retune on capacity"),
                       (_armed(ratios=()), "no 'moe_load_ratio' in the step metrics: no capacity band")):
        assert tuner.band is None and tuner.log.events("choose")[0].reason.endswith(why)
        assert not any(tuner.observe({LOAD_RATIO_KEY: 100.0}) for _ in range(10))
        assert tuner.log.events("retune") == []
    assert Autotuner().observe({LOAD_RATIO_KEY: 100.0}) is False  # never tuned


def test_load_ratio_against_numpy():
    counts = np.array([3, 9, 2, 2], np.int32)
    aux = MoEAux(jnp.zeros(()), jnp.asarray(counts), jnp.asarray(9), jnp.zeros(()))
    np.testing.assert_allclose(float(load_ratio(aux)), 4 * 9 / counts.sum(), rtol=1e-6)
    empty = MoEAux(jnp.zeros(()), jnp.zeros(4, jnp.int32), jnp.asarray(0), jnp.zeros(()))
    assert float(load_ratio(empty)) == 0.0
    assert metrics_load_ratio({}) is None and metrics_load_ratio({LOAD_RATIO_KEY: [1.0, 3.0]}) == 3.0
    with pytest.raises(ValueError, match="aux must be an MoEAux"):
        load_ratio(counts)
    # a real routing: the float64 reference's per-expert counts over k*S/E
    config = make_config({"type": "top", "k": 2, "capacity_factor": 1.0}, 8,
                         {"type": "ffn", "count_per_node": 4, "hidden_size_per_expert": 8})
    params = init_params(config, jax.random.key(1))
    x = np.asarray(jax.random.normal(jax.random.key(2), (40, 8)))
    _, aux = jax.jit(lambda p, x: moe_apply(p, x, config))(params, jnp.asarray(x))
    scores = ref.softmax(ref.top_logits(x.astype(np.float64), np.asarray(params["gates"][0]["wg"]["weight"])))
    *_, ref_counts, _ = ref.route(scores, 2, 1.0)
    np.testing.assert_allclose(float(load_ratio(aux)), ref_counts.max() / (2 * 40 / 4), rtol=1e-6)


def test_runtime_config_carries_the_dropless_impl_into_the_layout():
    config = make_config({"type": "top", "k": 2, "capacity_factor": 0.0}, 8,
                         {"type": "ffn", "count_per_node": 4, "hidden_size_per_expert": 8}, dropless_impl="ragged")
    loop = RuntimeConfig.ep(8, adaptive_r=0, dropless_impl="loop")
    assert plan_layout(config, loop).config.dropless_impl == "loop"
    assert plan_layout(config, loop.replace(dropless_impl=None)).config.dropless_impl == "ragged"  # the layer's own
    assert loop != loop.replace(dropless_impl="bucketed") and loop != loop.replace(dropless_impl=None)  # cache keys
    assert loop.describe().endswith(" dropless=loop") and "dropless" not in EP8.describe()
    with pytest.raises(ValueError, match=r"dropless_impl must be one of \('auto', .*'loop'.*\) or None, got 'fast'"):
        RuntimeConfig.ep(8, dropless_impl="fast")
    with pytest.raises(ValueError, match=r"cannot switch to \[.* dropless=native\]: dropless_impl='native' runs "
                                         r"SwiGLU \(silu\) or GPT-OSS experts, float or packed; got FFNExperts"):
        plan_layout(config, RuntimeConfig.ep(8, dropless_impl="native"))


# -- a real trainer with a fake clock ------------------------------------------------------------------------------
M, H, E = 16, 16, 4
STEP_COST = {EP8: 9 * MS, EP4_DP2: 4 * MS, EP2_DP4: 6 * MS}
COMPILE_COST = {EP8: 1.0, EP4_DP2: 50.0, EP2_DP4: 2.0}  # the fastest steps have the slowest compile


def _loss_fn(params, batch, moe):
    y, aux = moe(params["moe"], batch["x"] @ params["proj"])
    return jnp.mean((y - batch["t"]) ** 2) + 0.01 * aux.l_aux, {LOAD_RATIO_KEY: load_ratio(aux)}


def _trainer(capacity_factor: float) -> MoETrainer:
    config = make_config({"type": "top", "k": 2, "capacity_factor": capacity_factor}, M,
                         {"type": "ffn", "count_per_node": E, "hidden_size_per_expert": H})
    params = {"proj": jax.random.normal(jax.random.key(3), (M, M)) / 4, "moe": init_params(config, jax.random.key(0))}
    return MoETrainer(config, _loss_fn, optax.adam(1e-2), params, EP8, deterministic=True)


def _batches(batch_size: int = 8):
    i = 0
    while True:
        x = jax.random.normal(jax.random.key(200 + i), (batch_size, 4, M))
        yield {"x": x, "t": jnp.tanh(x)}
        i += 1


class TrainerClock:
    """Advances by STEP_COST[the running config] per step taken and COMPILE_COST[...] per step compiled since the
    previous reading (configs compared after plan_layout resolves them)."""

    def __init__(self, trainer: MoETrainer):
        self.trainer, self.now = trainer, 0.0
        self.steps, self.compiles = int(trainer.state.step), trainer.cache_info().compiles
        self.resolved = {trainer.plan(rt).runtime: rt for rt in STEP_COST}

    def __call__(self) -> float:
        steps, compiles = int(self.trainer.state.step), self.trainer.cache_info().compiles
        rt = self.resolved.get(self.trainer.runtime)
        if steps > self.steps or compiles > self.compiles:
            self.now += (steps - self.steps) * STEP_COST[rt] + (compiles - self.compiles) * COMPILE_COST[rt]
        self.steps, self.compiles = steps, compiles
        return self.now


@pytest.fixture(scope="module")
def tuned():
    """A bounded-dropless trainer (cf = -1: the capacity follows the routing) tuned over three layouts."""
    trainer = _trainer(-1.0)
    clock = TrainerClock(trainer)
    seen: list[dict] = []
    report = trainer.autotune([EP8, EP4_DP2, EP2_DP4], batches=_batches(), warmup=1, measure=3, clock=clock,
                              on_step=seen.append)
    return trainer, clock, report, seen


def test_trainer_autotune_chooses_the_fastest_steps_and_trains_on_live_batches(tuned):
    trainer, clock, report, seen = tuned
    assert report.chosen == trainer.runtime == trainer.plan(EP4_DP2).runtime and report.label == "data2 x ep4"
    assert report.default == EP8 and report.speedup == 9 / 4
    assert [m.median_s for m in report.measurements] == [9 * MS, 4 * MS, 6 * MS]
    assert [m.step_times_s for m in report.measurements] == [(9 * MS,) * 3, (4 * MS,) * 3, (6 * MS,) * 3]
    assert [m.compile_s for m in report.measurements] == [1.0, 50.0, 2.0]  # measured apart from the steps
    assert report.compile_s == 53.0 and clock.now == 53.0 + 4 * (9 + 4 + 6) * MS
    assert report.steps == 12 == int(trainer.state.step) == len(seen)  # (1 warmup + 3 timed) x 3: real steps
    assert trainer.cache_info().compiles == 3
    log = trainer.autotune_log.entries
    assert [e.event for e in log] == ["measure", "measure", "measure", "choose"]
    assert log[-1].reason.startswith("chose data2 x ep4: 3.91 ms/step, 2.25x faster than the default ep8 "
                                     "(8.79 ms/step)")
    # the band sits around the median load ratio of the chosen layout's timed steps (steps 6, 7, 8 of 12)
    ratio = float(np.median([float(m[LOAD_RATIO_KEY]) for m in seen[5:8]]))
    assert report.measurements[1].load_ratio == ratio and report.band == (ratio / 1.25, ratio * 1.25)
    assert report.as_dict()["chosen"] == trainer.runtime.describe()


def test_trainer_retunes_after_patience_and_reuses_compiled_steps(tuned):
    trainer, clock, report, _ = tuned
    high = report.band[1] * 1.5
    metrics = trainer.step(next(_batches()))
    assert trainer.observe_routing(metrics) is False  # a real step of the tuned routing stays in the band
    assert [trainer.observe_routing({LOAD_RATIO_KEY: high}) for _ in range(3)] == [False, False, True]
    assert trainer.autotune_log.events("retune")[-1].load_ratio == high
    compiles, steps = trainer.cache_info().compiles, int(trainer.state.step)
    again = trainer.autotune([EP8, RuntimeConfig.ep(3), EP4_DP2, EP2_DP4], batches=_batches(), clock=clock,
                             warmup=0, measure=2, strict=False)
    assert trainer.cache_info().compiles == compiles and again.compile_s == 0.0  # every step was cached
    assert int(trainer.state.step) == steps + 6 and again.chosen == trainer.plan(EP4_DP2).runtime
    assert [label for label, _ in again.skipped] == ["ep3"]
    assert "the expert-axis size 3 must divide the number of experts E=4" in again.skipped[0][1]
    events = [e.event for e in trainer.autotune_log.entries]
    assert events[4:] == ["retune", "skip-invalid", "measure", "measure", "measure", "choose"]


def test_fork_shares_compiled_steps_but_not_the_state(tuned):
    trainer = tuned[0]
    fork = trainer.fork()
    compiles, steps = trainer.cache_info().compiles, int(trainer.state.step)
    b = next(_batches())
    fork_loss = float(fork.step(b)["loss"])
    assert int(trainer.state.step) == steps and int(fork.state.step) == steps + 1  # the parent did not move
    assert float(trainer.step(b)["loss"]) == fork_loss  # the same state, the same executable
    fork.switch(EP8)
    fork.step(b)
    assert trainer.cache_info().compiles == fork.cache_info().compiles == compiles  # nothing compiled twice
    assert trainer.runtime == trainer.plan(EP4_DP2).runtime and len(fork.autotune_log) == 0


def test_trainer_autotune_validates_every_candidate_before_any_step():
    trainer = _trainer(1.0)
    with pytest.raises(ValueError) as info:  # a batch of 4 does not split over 8 token shards
        trainer.autotune([RuntimeConfig.ep(4), EP4_DP2, RuntimeConfig.ep(3), RuntimeConfig.ep(4, top_k=5)],
                         batches=_batches(batch_size=4))
    text = str(info.value)
    assert text.startswith("autotune: 3 of 4 candidates are invalid: [data2 x ep4] cannot switch to")
    assert "leading dimension 4 is not divisible by its 8 token shards" in text
    assert "[ep3] cannot switch to" in text and "[ep4 k=5] cannot switch to" in text and "top_k=5 exceeds" in text
    assert int(trainer.state.step) == 0 and trainer.cache_info().compiles == 0 and len(trainer.autotune_log) == 0
    with pytest.raises(ValueError, match="measure must be an integer >= 1"):
        trainer.autotune([EP8], batches=_batches(), measure=0)
    with pytest.raises(ValueError, match="batches must be an iterator, an iterable or a zero-argument callable"):
        trainer.autotune([EP8], batches=3)


def test_fixed_capacity_trainer_never_asks_to_retune():
    trainer = _trainer(1.0)
    gen = _batches()
    two = [next(gen), next(gen)]
    with pytest.raises(ValueError, match=r"`batches` ran out after 2 batches"):
        trainer.autotune([EP8], batches=two, warmup=1, measure=2)  # an iterable, consumed in order
    assert int(trainer.state.step) == 2
    report = trainer.autotune([EP8], batches=_batches(), warmup=0, measure=1, clock=TrainerClock(trainer))
    assert report.band is None and "fixed capacity" in report.reason
    assert not any(trainer.observe_routing({LOAD_RATIO_KEY: 50.0}) for _ in range(5))
