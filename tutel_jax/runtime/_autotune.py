"""Adaptive runtime: measure candidate runtime configs, keep the fastest, tune again when the routing moves.

Tutel's paper describes a runtime that picks the fastest parallelism and pipelining as the capacity an MoE layer
needs changes. This module is that decision logic, pure and clock-injectable; `MoETrainer.autotune` drives it
with real training steps (see `tutel_jax.training._trainer`).

* :class:`Autotuner.tune` validates every candidate first (`check`, e.g. `plan_layout` and the batch shape),
  then measures each valid one with a `measure(candidate)` callable (step times; compile time reported
  separately and never counted), picks the fastest median (ties: the earlier candidate) and records why in a
  :class:`DecisionLog`.
* The capacity band: where the capacity follows the routing (capacity_factor 0, dropless, or < 0, bounded
  dropless), the fastest configuration depends on how unevenly the tokens spread over the experts. That spread
  is the *load ratio* (:func:`load_ratio`): the largest per-expert dispatch count over the balanced count
  k*S/E (1 = perfectly balanced, E/k = every token on the same k experts). Tuning records the chosen
  candidate's median ratio r and the band [r / (1 + tol), r * (1 + tol)]; :meth:`Autotuner.observe` returns True
  once `patience` consecutive steps had a ratio outside it, i.e. a retune is due. With a fixed capacity
  (capacity_factor > 0) the shapes never follow the routing, so there is no band and no retune on capacity.

The metrics key carrying the load ratio is :data:`LOAD_RATIO_KEY` ('moe_load_ratio'): a loss function returns
``metrics["moe_load_ratio"] = load_ratio(aux)`` (for several MoE layers the max over them, or an array [L] of
per-layer ratios: the band watches its max).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..layer import MoEAux
from ._reconfigure import RuntimeConfig
from ..validation import check_choice, check_int

__all__ = ["LOAD_RATIO_KEY", "EVENTS", "load_ratio", "metrics_load_ratio", "short_name", "Candidate", "Sample",
           "Measurement", "LogEntry", "DecisionLog", "Decision", "Autotuner"]

#: the step-metrics key the capacity band reads: the MoE layers' load ratio (`load_ratio`)
LOAD_RATIO_KEY = "moe_load_ratio"

#: the decision log's events
EVENTS = ("measure", "choose", "retune", "skip-invalid")


def load_ratio(aux: MoEAux) -> jax.Array:
    """[] float32: an MoE call's load-imbalance ratio, max_e count_e / (k*S/E).

    `aux.dispatch_count` [E] holds every expert's assignments before dropping (summed over the token shards for
    `moe_apply_parallel`); they add up to k*S (the valid tokens' k choices), so the balanced count k*S/E is
    their mean and the ratio is E * max(count) / sum(count): 1 when balanced, E/k when every token picks the
    same k experts. 0 for a call without tokens. This is the capacity a dropless layer needs, in units of the
    balanced load.
    """
    if not isinstance(aux, MoEAux):
        raise ValueError(f"load_ratio: aux must be an MoEAux, got {type(aux).__name__}")
    counts = aux.dispatch_count.astype(jnp.float32)
    total = jnp.sum(counts)
    return jnp.where(total > 0, counts.shape[-1] * jnp.max(counts) / jnp.maximum(total, 1.0), 0.0)


def short_name(runtime: RuntimeConfig) -> str:
    """A short label for reasons and tables, e.g. 'ep8', 'data2 x ep4 d=2', '2dh 2x4', 'ep8 r=0 dropless=loop'.

    Shows the data axes (size > 1), the expert group (ep<W>, or 2dh <node>x<local>), and the switches that are
    set: r (unless None or 1), d (> 1), k, cf, the dropless impl."""
    sizes = dict(runtime.mesh_shape)
    data = [f"{name}{size}" for name, size in runtime.mesh_shape if name not in runtime.expert_axes and size > 1]
    if runtime.use_2dh:
        expert = "2dh " + "x".join(str(sizes[a]) for a in runtime.expert_axes)
    else:
        expert = f"ep{runtime.expert_world_size}"
    parts = [" x ".join(data + [expert])]
    if runtime.adaptive_r not in (None, 1):
        parts.append(f"r={runtime.adaptive_r}")
    if runtime.a2a_ffn_overlap_degree > 1:
        parts.append(f"d={runtime.a2a_ffn_overlap_degree}")
    if runtime.top_k is not None:
        parts.append(f"k={runtime.top_k}")
    if runtime.capacity_factor is not None:
        parts.append(f"cf={runtime.capacity_factor:g}")
    if runtime.dropless_impl is not None:
        parts.append(f"dropless={runtime.dropless_impl}")
    return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration to try.

    Attributes:
      runtime: the RuntimeConfig.
      label: the name used in reasons and tables (default `short_name(runtime)`).
    """

    runtime: RuntimeConfig
    label: str = ""

    def __post_init__(self):
        if not isinstance(self.runtime, RuntimeConfig):
            raise ValueError(f"Candidate.runtime must be a RuntimeConfig, got {type(self.runtime).__name__}")
        if not self.label:
            object.__setattr__(self, "label", short_name(self.runtime))

    @classmethod
    def of(cls, item: "Candidate | RuntimeConfig") -> "Candidate":
        """`item` as a Candidate (a RuntimeConfig gets the default label)."""
        if isinstance(item, Candidate):
            return item
        if isinstance(item, RuntimeConfig):
            return cls(item)
        raise ValueError(f"candidates must be RuntimeConfig or Candidate objects, got {type(item).__name__}")


@dataclasses.dataclass(frozen=True)
class Sample:
    """What one `measure(candidate)` call returns (a plain list of step seconds is read as Sample(times)).

    Attributes:
      step_times_s: seconds of each timed step (compilation excluded).
      compile_s: seconds spent compiling for this candidate (reported, never counted in the step time).
      load_ratios: the load ratio of each timed step (`LOAD_RATIO_KEY`), empty when the metrics had none.
    """

    step_times_s: tuple[float, ...]
    compile_s: float = 0.0
    load_ratios: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class Measurement:
    """A measured candidate: step times [runs] (seconds), compile seconds, load ratios [runs] (maybe empty)."""

    candidate: Candidate
    step_times_s: tuple[float, ...]
    compile_s: float
    load_ratios: tuple[float, ...] = ()

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_times_s)

    @property
    def runs(self) -> int:
        return len(self.step_times_s)

    @property
    def load_ratio(self) -> float | None:
        """The median load ratio of the timed steps, or None when they reported none."""
        return statistics.median(self.load_ratios) if self.load_ratios else None

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.candidate.label, "config": self.candidate.runtime.describe(),
                "median_s": self.median_s, "runs": self.runs, "step_times_s": list(self.step_times_s),
                "compile_s": self.compile_s, "load_ratio": self.load_ratio}


@dataclasses.dataclass(frozen=True)
class LogEntry:
    """One decision-log entry.

    Attributes:
      time: the clock's reading when it was recorded.
      event: one of EVENTS: 'measure' (a candidate timed), 'choose' (the fastest kept), 'retune' (the load ratio
        left the band for `patience` steps), 'skip-invalid' (a candidate refused before any measurement).
      config: the candidate's `RuntimeConfig.describe()` ('retune': the running one's).
      label: the candidate's label.
      median_s, runs, step_times_s: its measured step times ('measure', 'choose'; None / 0 / () otherwise).
      compile_s: its compile seconds, separate from the step times ('measure', 'choose').
      load_ratio: the median load ratio measured ('measure', 'choose') or the one observed ('retune').
      band: the capacity band (low, high) of the load ratio ('choose': the one armed, 'retune': the one left).
      reason: a human-readable why.
    """

    time: float
    event: str
    config: str
    label: str
    reason: str
    median_s: float | None = None
    runs: int = 0
    step_times_s: tuple[float, ...] = ()
    compile_s: float | None = None
    load_ratio: float | None = None
    band: tuple[float, float] | None = None

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["step_times_s"] = list(self.step_times_s)
        d["band"] = None if self.band is None else list(self.band)
        return d


class DecisionLog:
    """The autotuner's decisions in order (`entries`: a list of LogEntry); one log may span several tunings."""

    def __init__(self) -> None:
        self.entries: list[LogEntry] = []

    def add(self, entry: LogEntry) -> LogEntry:
        check_choice(entry.event, "log event", EVENTS)
        self.entries.append(entry)
        return entry

    def events(self, event: str | None = None) -> list[LogEntry]:
        """The entries of one event (all when None)."""
        return [e for e in self.entries if event is None or e.event == event]

    def as_dicts(self) -> list[dict[str, Any]]:
        return [e.as_dict() for e in self.entries]

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):
        return iter(self.entries)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What one `Autotuner.tune` chose.

    Attributes:
      chosen: the fastest measurement (ties: the earlier candidate).
      default: the first valid candidate's measurement (the configuration one would run without tuning).
      measurements: every valid candidate's, in candidate order.
      skipped: (candidate, reason) of every invalid candidate (non-strict tuning).
      band: the capacity band armed for the chosen one, or None (fixed capacity, or no load ratios).
      reason: why (the 'choose' entry's reason).
    """

    chosen: Measurement
    default: Measurement
    measurements: tuple[Measurement, ...]
    skipped: tuple[tuple[Candidate, str], ...]
    band: tuple[float, float] | None
    reason: str

    @property
    def speedup(self) -> float:
        """Default median / chosen median (>= 1)."""
        return self.default.median_s / self.chosen.median_s if self.chosen.median_s > 0 else 1.0


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms/step"


def metrics_load_ratio(metrics: Mapping[str, Any]) -> float | None:
    """A step's load ratio from its metrics: the max of `metrics[LOAD_RATIO_KEY]` (a scalar or [L] per-layer
    ratios) as a float, or None when the key is absent."""
    if LOAD_RATIO_KEY not in metrics:
        return None
    arr = np.asarray(metrics[LOAD_RATIO_KEY], dtype=np.float64)
    if arr.size == 0:
        raise ValueError(f"metrics[{LOAD_RATIO_KEY!r}] is empty")
    return float(arr.max())


class Autotuner:
    """Chooses the fastest of a set of candidates and watches the capacity band it was tuned for.

    Args:
      clock: seconds, for the log's time stamps (and for callers timing steps with the same clock).
      tolerance: the band's relative width: [r / (1 + tolerance), r * (1 + tolerance)] around the tuned ratio r.
      patience: consecutive out-of-band observations before `observe` reports a retune.
      log: the DecisionLog to append to (default a new one).
    """

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter, tolerance: float = 0.25,
                 patience: int = 3, log: DecisionLog | None = None):
        if not (isinstance(tolerance, (int, float)) and math.isfinite(tolerance) and tolerance > 0):
            raise ValueError(f"retune tolerance must be a finite number > 0, got {tolerance!r}")
        check_int(patience, "patience", minimum=1)
        if not callable(clock):
            raise ValueError(f"clock must be a callable returning seconds, got {clock!r}")
        self.clock = clock
        self.tolerance = float(tolerance)
        self.patience = patience
        self.log = DecisionLog() if log is None else log
        self.decision: Decision | None = None
        self._band: tuple[float, float] | None = None
        self._outside = 0

    @property
    def band(self) -> tuple[float, float] | None:
        """The armed capacity band (low, high) of the load ratio, or None."""
        return self._band

    def _record(self, event: str, candidate: Candidate | None, reason: str, **fields: Any) -> LogEntry:
        config = "" if candidate is None else candidate.runtime.describe()
        label = "" if candidate is None else candidate.label
        return self.log.add(LogEntry(time=float(self.clock()), event=event, config=config, label=label,
                                     reason=reason, **fields))

    # -- validation ------------------------------------------------------------------------------------------
    def validate(self, candidates: Iterable[Candidate | RuntimeConfig], check: Callable[[Candidate], Any] | None,
                 *, strict: bool = True) -> tuple[list[Candidate], list[tuple[Candidate, str]]]:
        """Splits the candidates into valid ones and (candidate, reason) of invalid ones, measuring nothing.

        `check(candidate)` raises ValueError for an invalid one. With `strict`, any invalid candidate raises one
        ValueError listing them all; otherwise each is logged as 'skip-invalid'. No candidates, or none valid,
        raises ValueError."""
        items = [Candidate.of(c) for c in candidates]
        if not items:
            raise ValueError("autotune: the candidate list is empty")
        valid, invalid = [], []
        for c in items:
            try:
                if check is not None:
                    check(c)
            except ValueError as exc:
                invalid.append((c, str(exc)))
            else:
                valid.append(c)
        listing = "; ".join(f"[{c.label}] {why}" for c, why in invalid)
        if invalid and strict:
            raise ValueError(f"autotune: {len(invalid)} of {len(items)} candidates are invalid: {listing}")
        if not valid:
            raise ValueError(f"autotune: none of the {len(items)} candidates is valid: {listing}")
        for c, why in invalid:
            self._record("skip-invalid", c, f"skipped {c.label}: {why}")
        return valid, invalid

    # -- tuning ----------------------------------------------------------------------------------------------
    def tune(self, candidates: Iterable[Candidate | RuntimeConfig],
             measure: Callable[[Candidate], Sample | Sequence[float]], *,
             check: Callable[[Candidate], Any] | None = None, strict: bool = True,
             follows_routing: Callable[[Candidate], bool] | None = None) -> Decision:
        """Validates all candidates, then measures each valid one in order and picks the fastest median.

        Args:
          candidates: RuntimeConfig or Candidate objects; the first valid one is the default.
          measure: ``measure(candidate) -> Sample`` (or a list of step seconds); called once per valid candidate,
            after every candidate has been validated.
          check: ``check(candidate)`` raising ValueError for an invalid candidate (see `validate`).
          strict: invalid candidates raise (True) or are skipped and logged (False).
          follows_routing: whether a candidate's capacity follows the routing (capacity_factor <= 0); default:
            every candidate does. The band is armed only for a chosen candidate that does and has load ratios.

        Returns:
          The Decision (also `self.decision`); the band is armed (`observe` counts from zero).
        """
        valid, invalid = self.validate(candidates, check, strict=strict)
        measurements = []
        for c in valid:
            sample = measure(c)
            if not isinstance(sample, Sample):
                sample = Sample(tuple(sample))
            times = tuple(float(t) for t in sample.step_times_s)
            if not times:
                raise ValueError(f"autotune: measure returned no step times for [{c.label}]")
            m = Measurement(c, times, float(sample.compile_s), tuple(float(r) for r in sample.load_ratios))
            measurements.append(m)
            ratio = "" if m.load_ratio is None else f", load ratio {m.load_ratio:.3g}"
            self._record("measure", c, f"{c.label}: {_ms(m.median_s)} (median of {m.runs}){ratio}; compile "
                                       f"{m.compile_s:.3g} s, not counted", **self._fields(m))
        chosen = measurements[0]
        for m in measurements[1:]:
            if m.median_s < chosen.median_s:  # strict: a tie keeps the earlier candidate
                chosen = m
        default = measurements[0]
        reason = self._choose_reason(chosen, default, measurements)
        band, why_band = self._band_for(chosen, follows_routing)
        reason += f"; {why_band}"
        self._record("choose", chosen.candidate, reason, band=band, **self._fields(chosen))
        self._band, self._outside = band, 0
        self.decision = Decision(chosen=chosen, default=default, measurements=tuple(measurements),
                                 skipped=tuple(invalid), band=band, reason=reason)
        return self.decision

    @staticmethod
    def _fields(m: Measurement) -> dict[str, Any]:
        return dict(median_s=m.median_s, runs=m.runs, step_times_s=m.step_times_s, compile_s=m.compile_s,
                    load_ratio=m.load_ratio)

    @staticmethod
    def _choose_reason(chosen: Measurement, default: Measurement, measurements: Sequence[Measurement]) -> str:
        if chosen is default:
            text = f"kept the default {chosen.candidate.label}: {_ms(chosen.median_s)}, the fastest of " \
                   f"{len(measurements)}"
            others = [m for m in measurements if m is not chosen]
            if others:
                nxt = min(others, key=lambda m: m.median_s)
                text += f" (next: {nxt.candidate.label}, {nxt.median_s / max(chosen.median_s, 1e-12):.2f}x slower)"
            return text
        speedup = default.median_s / max(chosen.median_s, 1e-12)
        return (f"chose {chosen.candidate.label}: {_ms(chosen.median_s)}, {speedup:.2f}x faster than the default "
                f"{default.candidate.label} ({_ms(default.median_s)})")

    def _band_for(self, chosen: Measurement, follows_routing: Callable[[Candidate], bool] | None
                  ) -> tuple[tuple[float, float] | None, str]:
        if follows_routing is not None and not follows_routing(chosen.candidate):
            return None, "fixed capacity (capacity_factor > 0): no retune on capacity"
        ratio = chosen.load_ratio
        if ratio is None:
            return None, f"no {LOAD_RATIO_KEY!r} in the step metrics: no capacity band"
        band = (ratio / (1.0 + self.tolerance), ratio * (1.0 + self.tolerance))
        return band, f"capacity band [{band[0]:.3g}, {band[1]:.3g}] around load ratio {ratio:.3g}"

    # -- re-evaluation ---------------------------------------------------------------------------------------
    def observe(self, metrics: Mapping[str, Any]) -> bool:
        """Feeds one step's metrics; True when a retune is due.

        With no band armed (fixed capacity, no load ratios, or not tuned yet) always False. Otherwise
        `metrics[LOAD_RATIO_KEY]` (its max, for per-layer ratios) is compared with the band (bounds included):
        after `patience` consecutive out-of-band steps it logs a 'retune' entry and returns True; the count then
        restarts (so it fires again after `patience` more such steps if no retune follows). An in-band step
        resets the count."""
        if self._band is None:
            return False
        ratio = metrics_load_ratio(metrics)
        if ratio is None:
            raise ValueError(f"observe: the step metrics have no {LOAD_RATIO_KEY!r} (the load ratio the capacity "
                             f"band was armed with); got keys {sorted(metrics)}")
        low, high = self._band
        if low <= ratio <= high:
            self._outside = 0
            return False
        self._outside += 1
        if self._outside < self.patience:
            return False
        self._outside = 0
        chosen = None if self.decision is None else self.decision.chosen.candidate
        self._record("retune", chosen, f"load ratio {ratio:.3g} outside the band [{low:.3g}, {high:.3g}] for "
                                       f"{self.patience} consecutive steps", load_ratio=ratio, band=self._band)
        return True
