"""The evaluation engine: one state machine per (rule, series), fed report by report.

States (:mod:`trainvitals.alerts.state`): inactive -> pending -> firing ->
resolved (-> pending/firing again).

- ``for_steps`` counts optimizer steps (the report's ``step``): an alert fires on
  the first report at least ``for_steps`` steps after the one that made it
  pending, if every report of that series in between was past the threshold.
  ``for`` does the same in seconds of ``now``. Both are checked when evidence
  arrives (on ``observe``), as Prometheus checks them at evaluation.
- Hysteresis: a firing alert resolves only when the value gets back to ``clear``
  (inclusive), and stays so for ``hold_steps``/``hold``. A value between
  ``clear`` and the threshold keeps it firing; a pending alert needs every value
  past the threshold, so the band resets it.
- ``and`` conditions: the alert is past the threshold only when every condition
  holds too. A condition reads the other metric's series whose labels equal the
  primary series' labels restricted to that metric's labels (same run and rank),
  from the latest report that carried that metric
  (:mod:`trainvitals.alerts.conditions`). A condition that is clearly
  false counts as "clear" (fixing the weight decay resolves ParamDrift even
  while the drift is still large).
- No evidence: NaN, a series missing from a report, an ``and`` series not yet
  seen, the first report of a counter (``increase`` needs two) or a spike
  history shorter than ``window`` (:mod:`trainvitals.alerts.transforms`): the
  state stays as it is. A NaN never satisfies ``above``/``below`` and never
  clears; non-finite losses are caught by NonFiniteLoss from the counter. +Inf
  does satisfy ``above``.
- Series: labelled as the collector's store labels them
  (:func:`trainvitals.wire.series_labels`: ``run``, ``rank`` unless 0, then the
  sample's labels).
- Event rules fire on the report that carries the event and resolve on a later
  report of the same run without it, once ``hold_steps``/``hold`` have passed
  since the last such event. A ``run_end`` event marks a run finished:
  RunSilent stays quiet for it, and its firing alerts resolve with the reason
  (``run r ended at step s``; pending ones are dropped) unless the engine was built
  with ``resolve_on_run_end=False`` (a replay judging what fired up to the end).
- Timers (``tick``): RunSilent, holds in seconds, forgetting runs silent for
  ``run_ttl`` (their alerts resolve) and dropping resolved alerts after
  ``resolved_retention``.

The engine takes rule objects (:func:`trainvitals.alerts.loading.resolve_rules`
turns names, files and folders into them). Pure Python; thread-safe (one
lock); no I/O.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from os import PathLike
from typing import Any

from trainvitals.alerts.conditions import LabelPredicate, LatestSamples
from trainvitals.alerts.instances import (
    EXPORTED_FIELDS,
    AlertInstance,
    RunState,
    export_row,
    number_or_nan,
    rule_index_of,
)
from trainvitals.alerts.model import (
    RULE_TYPES,
    Condition,
    EventRule,
    Rule,
    SilenceRule,
    ThresholdRule,
)
from trainvitals.alerts.state import Alert, AlertState, LabelItems, Transition
from trainvitals.alerts.transforms import SeriesHistory
from trainvitals.wire import ends_run, series_labels
from trainvitals.wire.coverage import coverage_samples
from trainvitals.wire.views import ReportView

__all__ = ["DEFAULT_MAX_ALERTS_PER_RULE", "Engine"]

log = logging.getLogger("trainvitals.alerts")

DEFAULT_MAX_ALERTS_PER_RULE = 64
"""Alerts one rule may hold in one run (firing, pending or recently resolved) before more
are only counted: a rule keyed on a free label otherwise opens one alert per value."""

# Verdicts of one observation.
_BAD, _BAND, _CLEAR, _UNKNOWN = "bad", "band", "clear", "unknown"


@dataclass(eq=False)
class _Compiled:
    """A threshold rule with its matchers compiled."""

    index: int
    rule: ThresholdRule
    match: LabelPredicate | None
    conditions: list[tuple[Condition, LabelPredicate | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # For the ingest loop: a plain-value rule can skip a sample on its value alone.
        self.plain = self.rule.transform == "value"
        self.above = self.rule.above
        self.below = self.rule.below


def _compile_matchers(matchers) -> LabelPredicate:
    preds = [(m.name, m.compile()) for m in matchers]
    if not preds:
        return lambda labels: True
    return lambda labels: all(pred(labels.get(name)) for name, pred in preds)


def _hold_done(rule: Rule, inst: AlertInstance, step: int | None, now: float) -> bool:
    hold_steps = getattr(rule, "hold_steps", 0)
    hold = getattr(rule, "hold", 0.0)
    if hold_steps and (step is None or inst.clear_step is None or step - inst.clear_step < hold_steps):
        return False
    return inst.clear_time is not None and (hold <= 0 or now - inst.clear_time >= hold)


def _rule_objects(rules: Iterable[Rule]) -> list[Rule]:
    if rules is None or isinstance(rules, str | bytes | PathLike):
        raise TypeError(
            f"Engine takes rule objects, not {rules!r}: resolve names, files and folders first with resolve_rules()"
        )
    out = list(rules)
    for i, rule in enumerate(out, start=1):
        if not isinstance(rule, RULE_TYPES):
            raise TypeError(
                f"Engine rule #{i} is a {type(rule).__name__}, not a rule object "
                "(ThresholdRule, EventRule or SilenceRule); see resolve_rules()"
            )
    return out


class Engine:
    """Evaluates rules against reports; returns the state changes.

    ``rules``: rule objects (:func:`trainvitals.alerts.loading.resolve_rules`
    makes them from ``"default"``, files and folders). ``observe(report, now)``
    on every report, ``tick(now)`` every second or so for the timers. ``now`` is
    the collector's clock (Unix seconds); ``run_ttl`` and ``resolved_retention``
    are seconds.
    """

    def __init__(
        self,
        rules: Iterable[Rule],
        *,
        run_ttl: float = 86400.0,
        resolved_retention: float = 900.0,
        max_alerts_per_rule: int = DEFAULT_MAX_ALERTS_PER_RULE,
        resolve_on_run_end: bool = True,
    ) -> None:
        if max_alerts_per_rule < 1:
            raise ValueError(f"max_alerts_per_rule must be at least 1, got {max_alerts_per_rule}")
        self.rules: list[Rule] = _rule_objects(rules)
        self.max_alerts_per_rule = max_alerts_per_rule
        # A run that ends resolves its alerts; resolve_on_run_end=False keeps what was still
        # firing at its end (a replay that judges a finished run's reports).
        self.resolve_on_run_end = resolve_on_run_end
        # (rule index, run) -> alerts held; past the bound new ones are counted, not opened.
        self._per_rule_run: dict[tuple[int, str], int] = {}
        self._flooded: set[tuple[int, str]] = set()  # said once per rule and run
        self.suppressed: dict[str, int] = {}
        """Alerts not opened past ``max_alerts_per_rule``, by alert name."""
        self.run_ttl = run_ttl
        self.resolved_retention = resolved_retention
        self._lock = threading.Lock()
        self._by_metric: dict[str, list[_Compiled]] = {}
        self._by_event: dict[str, list[tuple[int, EventRule, Callable]]] = {}
        self._silence: list[tuple[int, SilenceRule]] = []
        and_metrics: set[str] = set()
        for i, rule in enumerate(self.rules):
            if isinstance(rule, ThresholdRule):
                c = _Compiled(
                    i,
                    rule,
                    _compile_matchers(rule.labels) if rule.labels else None,
                    [(cond, _compile_matchers(cond.labels) if cond.labels else None) for cond in rule.and_],
                )
                self._by_metric.setdefault(rule.metric, []).append(c)
                and_metrics.update(cond.metric for cond in rule.and_)
            elif isinstance(rule, EventRule):
                self._by_event.setdefault(rule.event, []).append((i, rule, _compile_matchers(rule.labels)))
            else:
                self._silence.append((i, rule))
        # metric -> (threshold rules on it, whether `and` conditions read it): one
        # dict lookup per sample on the ingest path.
        self._interest: dict[str, tuple[list[_Compiled], bool]] = {
            name: (self._by_metric.get(name, []), name in and_metrics) for name in set(self._by_metric) | and_metrics
        }
        self._event_rules = [(i, r) for i, r in enumerate(self.rules) if isinstance(r, EventRule)]
        # (rule index, run, rank, label items) -> instance
        self._instances: dict[tuple[int, str, int, LabelItems], AlertInstance] = {}
        # (run, rank) -> event-rule instances of that run, for holds.
        self._event_instances: dict[tuple[str, int], dict[tuple, AlertInstance]] = {}
        # What `and` conditions read: the latest report's samples of their metrics.
        self._latest = LatestSamples()
        # Instances per threshold rule: with none, a value short of the threshold
        # needs no state lookup at all.
        self._live = [0] * len(self.rules)
        # What transforms remember, per (rule index, run, rank, label items).
        self._history = SeriesHistory()
        self._runs: dict[str, RunState] = {}
        self._next_sweep = 0.0
        # Runs whose state changed since export_runs(dirty=True) last took them.
        self._dirty_runs: set[str] = set()

    # ------------------------------------------------------------------ observe

    def observe(self, report: ReportView, now: float | None = None) -> list[Transition]:
        """Evaluate one report; return the transitions it caused."""
        now = time.time() if now is None else now
        out: list[Transition] = []
        run, rank, step = report.run, report.rank, report.step
        with self._lock:
            info = self._runs.get(run)
            if info is None:
                self._runs[run] = info = RunState(now, step)
            else:
                info.last_seen = max(info.last_seen, now)
                info.last_step = step
            self._dirty_runs.add(run)
            ended = ends_run(report)
            info.closed = ended
            for i, _rule in self._silence:
                inst = self._instances.get((i, run, 0, ()))
                if inst is not None and inst.state is AlertState.FIRING:
                    inst.state, inst.resolved_at = AlertState.RESOLVED, now
                    inst.value, inst.reason = 0.0, f"run {run} reported again at step {step}"
                    out.append(inst.snapshot(Transition, old=AlertState.FIRING, reason=inst.reason))

            # First pass: remember values that `and` conditions look up, and the
            # samples some rule watches; evaluate once the whole report is known.
            matched: list[tuple[_Compiled, Any]] = []
            fresh: dict[str, list[Any]] = {}
            interest_get = self._interest.get
            live = self._live
            samples = report.samples
            if report.coverage:  # signal_active, as the collector's store exports it
                samples = [*samples, *coverage_samples(report.coverage)]
            for sample in samples:
                hit = interest_get(sample.name)
                if hit is None:
                    continue
                compiled, read_by_conditions = hit
                if read_by_conditions:
                    bucket = fresh.get(sample.name)
                    if bucket is None:
                        bucket = fresh[sample.name] = []
                    bucket.append(sample)
                for c in compiled:
                    if c.plain and not live[c.index]:
                        # Healthy fast path: no state for this rule anywhere, and a
                        # value that starts none (NaN compares false: skipped too).
                        value = sample.value
                        if c.above is not None:
                            if not value > c.above:
                                continue
                        elif c.below is not None and not value < c.below:
                            continue
                    if c.match is None or c.match(sample.labels):
                        matched.append((c, sample))
            for name, samples in fresh.items():
                self._latest.remember(run, rank, name, samples)
            # A plain rule with no instance anywhere and a condition whose metric this run
            # never reported cannot start one: skip its samples (asked once per rule).
            unmet: dict[int, bool] = {}
            for c, sample in matched:
                if c.conditions and c.plain and not live[c.index]:
                    skip = unmet.get(c.index)
                    if skip is None:
                        skip = unmet[c.index] = not self._latest.seen_all(c.conditions, run, rank)
                    if skip:
                        continue
                t = self._evaluate(c, run, rank, step, sample.labels, sample.value, now)
                if t is not None:
                    out.append(t)

            if self._event_rules:
                out.extend(self._observe_events(report, now))
            if ended and self.resolve_on_run_end:
                out.extend(self._end_run(run, step, now))
        return out

    def _end_run(self, run: str, step: int, now: float) -> list[Transition]:
        """The run reported its end: its firing alerts resolve (saying so), pending ones go."""
        out = []
        reason = f"run {run} ended at step {step}"
        for key, inst in list(self._instances.items()):
            if inst.run != run:
                continue
            if inst.state is AlertState.FIRING:
                inst.state, inst.resolved_at, inst.reason = AlertState.RESOLVED, now, reason
                out.append(inst.snapshot(Transition, old=AlertState.FIRING, reason=reason))
            elif inst.state is AlertState.PENDING:
                inst.state = AlertState.INACTIVE
                self._drop(key, inst)
        return out

    def _evaluate(
        self, c: _Compiled, run: str, rank: int, step: int, labels: Mapping[str, str], raw: float, now: float
    ) -> Transition | None:
        rule = c.rule
        items = tuple(sorted(labels.items()))
        key = (c.index, run, rank, items)
        value = self._history.apply(rule, key, raw) if rule.transform != "value" else raw
        if value is None or value != value:
            verdict = _UNKNOWN
        elif rule.above is not None:
            verdict = _BAD if value > rule.above else (_CLEAR if value <= rule.clear_at else _BAND)
        else:
            below = rule.below
            assert below is not None  # the model gives a threshold rule exactly one of above/below
            verdict = _BAD if value < below else (_CLEAR if value >= rule.clear_at else _BAND)
        inst = self._instances.get(key)
        if c.conditions and verdict != _UNKNOWN:
            if inst is None and not self._latest.seen_all(c.conditions, run, rank):
                # No state, and a condition's metric not reported yet: the conditions cannot
                # all hold, so nothing can start (the cheap path of a healthy run).
                return None
            holds = self._latest.verdict(c.conditions, run, rank, labels)
            if holds is False:  # a condition clearly false counts as cleared
                verdict = _CLEAR
            elif holds is None and verdict == _BAD:
                verdict = _UNKNOWN
        if verdict == _UNKNOWN or (inst is None and verdict != _BAD):
            if inst is not None and value is not None and value == value:
                inst.value = value
            return None
        if inst is None:
            inst = self._bounded_instance(key, rule, labels, run, rank)
            if inst is None:
                return None
        return self._advance(inst, verdict, value, step, now)  # type: ignore[arg-type]

    def _advance(self, inst: AlertInstance, verdict: str, value: float, step: int, now: float) -> Transition | None:
        rule = inst.rule
        old = inst.state
        inst.value, inst.step = value, step
        if old in (AlertState.INACTIVE, AlertState.RESOLVED):
            if verdict != _BAD:
                return None
            inst.state, inst.pending_step, inst.pending_time = AlertState.PENDING, step, now
            inst.fired_at = inst.resolved_at = None
            inst.reason = ""
            self._maybe_fire(inst, step, now)
        elif old is AlertState.PENDING:
            if verdict == _BAD:
                if step < inst.pending_step:  # the run restarted from an earlier checkpoint
                    inst.pending_step = step
                self._maybe_fire(inst, step, now)
            else:
                inst.state = AlertState.INACTIVE
                self._drop(inst.key, inst)
        else:  # firing
            if verdict != _CLEAR:
                inst.clear_step = inst.clear_time = None
            else:
                if inst.clear_step is None or step < inst.clear_step:
                    inst.clear_step, inst.clear_time = step, now
                if _hold_done(rule, inst, step, now):
                    inst.state, inst.resolved_at = AlertState.RESOLVED, now
        if inst.state is old:
            return None
        return inst.snapshot(Transition, old=old)

    def _maybe_fire(self, inst: AlertInstance, step: int, now: float) -> None:
        rule = inst.rule
        assert isinstance(rule, ThresholdRule)
        if step - inst.pending_step >= rule.for_steps and (rule.for_ <= 0 or now - inst.pending_time >= rule.for_):
            inst.state, inst.fired_at = AlertState.FIRING, now
            inst.fired_value = inst.value
            inst.clear_step = inst.clear_time = None

    def _observe_events(self, report: ReportView, now: float) -> list[Transition]:
        out: list[Transition] = []
        run, rank, step = report.run, report.rank, report.step
        per_run = self._event_instances.setdefault((run, rank), {})
        seen: set[tuple] = set()
        for ev in report.events:
            for i, rule, match in self._by_event.get(ev.kind, ()):
                if not match(ev.labels):
                    continue
                items = tuple(sorted(ev.labels.items()))
                key = (i, run, rank, items)
                seen.add(key)
                inst = self._instances.get(key)
                if inst is None:
                    inst = self._bounded_instance(key, rule, ev.labels, run, rank)
                    if inst is None:
                        continue
                    per_run[key] = inst
                old = inst.state
                inst.step, inst.detail = step, ev.detail
                inst.clear_step, inst.clear_time = step, now
                if old is AlertState.FIRING:
                    inst.value += 1
                    continue
                inst.value = inst.fired_value = 1.0
                inst.state, inst.pending_step, inst.pending_time = AlertState.FIRING, step, now
                inst.fired_at, inst.resolved_at, inst.reason = now, None, ""
                per_run[key] = inst
                out.append(inst.snapshot(Transition, old=old))
        for key, inst in list(per_run.items()):
            if key in seen or inst.state is not AlertState.FIRING:
                continue
            if step < (inst.clear_step or 0):
                inst.clear_step = step
            if _hold_done(inst.rule, inst, step, now):
                inst.state, inst.resolved_at, inst.step = AlertState.RESOLVED, now, step
                out.append(inst.snapshot(Transition, old=AlertState.FIRING))
        return out

    # --------------------------------------------------------------------- tick

    def tick(self, now: float | None = None) -> list[Transition]:
        """Run the timers: RunSilent, holds in seconds, forgetting old runs."""
        now = time.time() if now is None else now
        out: list[Transition] = []
        with self._lock:
            for run, info in list(self._runs.items()):
                silent = now - info.last_seen
                if silent >= self.run_ttl:
                    out.extend(self._forget_run(run, now))
                    continue
                if info.closed:
                    continue
                for i, rule in self._silence:
                    if silent < rule.silent_for:
                        continue
                    key: tuple[int, str, int, LabelItems] = (i, run, 0, ())
                    inst = self._instances.get(key)
                    if inst is None:
                        inst = self._new_instance(key, rule, series_labels(run, 0, {}), run)
                    inst.value, inst.step = silent, info.last_step
                    if inst.state is not AlertState.FIRING:
                        old = inst.state
                        inst.fired_value = silent
                        inst.state, inst.pending_time = AlertState.FIRING, now
                        inst.fired_at, inst.resolved_at, inst.reason = now, None, ""
                        out.append(inst.snapshot(Transition, old=old))
            # Holds measured in seconds can end without a report.
            for inst in self._instances.values():
                inst_rule = inst.rule
                if (
                    inst.state is AlertState.FIRING
                    and getattr(inst_rule, "hold", 0.0) > 0
                    and inst.clear_time is not None
                    and _hold_done(inst_rule, inst, inst.step, now)
                ):
                    inst.state, inst.resolved_at = AlertState.RESOLVED, now
                    out.append(inst.snapshot(Transition, old=AlertState.FIRING))
            if now >= self._next_sweep:
                self._next_sweep = now + min(10.0, self.resolved_retention)
                for key, inst in list(self._instances.items()):
                    if (
                        inst.state is AlertState.RESOLVED
                        and inst.resolved_at is not None
                        and now - inst.resolved_at >= self.resolved_retention
                    ):
                        self._drop(key, inst)
        return out

    def _bounded_instance(
        self, key: tuple, rule: Rule, labels: Mapping[str, str], run: str, rank: int
    ) -> AlertInstance | None:
        """A new alert of ``rule`` in ``run``, unless the rule holds ``max_alerts_per_rule``
        there already (a rule on a free label: one alert per value): then None, counted in
        :attr:`suppressed` and logged once per rule and run."""
        held = self._per_rule_run.get((key[0], run), 0)
        if held >= self.max_alerts_per_rule:
            self.suppressed[rule.alert] = self.suppressed.get(rule.alert, 0) + 1
            if (key[0], run) not in self._flooded:
                self._flooded.add((key[0], run))
                log.warning(
                    "rule %s holds %d alerts in run %r (max_alerts_per_rule): further ones in this run "
                    "are not opened or paged, only counted in trainvitals_alerts_suppressed_total",
                    rule.alert,
                    held,
                    run,
                )
            return None
        return self._new_instance(key, rule, series_labels(run, rank, labels), run)

    def _new_instance(self, key: tuple, rule: Rule, labels: dict[str, str], run: str) -> AlertInstance:
        inst = self._instances[key] = AlertInstance(rule, key[0], labels, run, key)
        self._live[key[0]] += 1
        per = (key[0], run)
        self._per_rule_run[per] = self._per_rule_run.get(per, 0) + 1
        return inst

    def _drop(self, key: tuple, inst: AlertInstance) -> None:
        del self._instances[key]
        self._live[key[0]] -= 1
        per = (key[0], inst.run)
        left = self._per_rule_run.get(per, 0) - 1
        if left > 0:
            self._per_rule_run[per] = left
        else:
            self._per_rule_run.pop(per, None)
        per_run = self._event_instances.get((key[1], key[2]))
        if per_run is not None:
            per_run.pop(key, None)

    def _forget_run(self, run: str, now: float) -> list[Transition]:
        out = []
        for key, inst in list(self._instances.items()):
            if inst.run != run:
                continue
            if inst.state is AlertState.FIRING:
                inst.state, inst.resolved_at = AlertState.RESOLVED, now
                inst.reason = f"run {run} sent nothing for {self.run_ttl:.0f} s and was forgotten"
                out.append(inst.snapshot(Transition, old=AlertState.FIRING, reason=inst.reason))
            self._drop(key, inst)
        self._history.forget_run(run)
        self._latest.forget_run(run)
        self._flooded = {f for f in self._flooded if f[1] != run}
        for run_rank in [k for k in self._event_instances if k[0] == run]:
            del self._event_instances[run_rank]
        del self._runs[run]
        self._dirty_runs.add(run)
        return out

    # ------------------------------------------------------------- persistence

    def export_runs(self, dirty: bool = False) -> list[tuple[str, float, int, bool] | tuple[str, None, None, None]]:
        """``(run, last_seen, last_step, closed)`` per run; ``dirty``: only the runs changed
        since the last such call, a forgotten run as ``(run, None, None, None)``."""
        with self._lock:
            names = list(self._dirty_runs) if dirty else list(self._runs)
            if dirty:
                self._dirty_runs.clear()
            out: list = []
            for name in names:
                info = self._runs.get(name)
                out.append(
                    (name, None, None, None) if info is None else (name, info.last_seen, info.last_step, info.closed)
                )
            return out

    def export_alerts(self) -> list[dict[str, Any]]:
        """Every pending, firing and recently resolved alert as a JSON-ready dict
        (what :meth:`restore` takes after a restart)."""
        with self._lock:
            return [
                export_row(key, inst) for key, inst in self._instances.items() if inst.state is not AlertState.INACTIVE
            ]

    def restore(
        self, runs: Iterable[tuple[str, float, int, bool]], alerts: Iterable[Mapping[str, Any]]
    ) -> list[Mapping[str, Any]]:
        """Bring back runs and alerts from before a restart; return the alerts whose rule
        is gone (their state cannot go on; the caller resolves them downstream).

        A run comes back with its last report time, so RunSilent covers a run that
        went silent across the restart; an alert with its state, so a firing one
        resolves when its series clears and does not fire (page) again while it holds.
        """
        gone = []
        with self._lock:
            for run, last_seen, last_step, closed in runs:
                if run not in self._runs:
                    self._runs[run] = RunState(last_seen, last_step, bool(closed))
            by_name: dict[str, list[int]] = {}
            for i, rule in enumerate(self.rules):
                by_name.setdefault(rule.alert, []).append(i)
            for row in alerts:
                index = rule_index_of(self.rules, by_name, row)
                if index is None:
                    gone.append(row)
                    continue
                items = tuple((str(k), str(v)) for k, v in row["items"])
                key = (index, row["run"], int(row["rank"]), items)
                if key in self._instances:
                    continue
                rule = self.rules[index]
                inst = self._new_instance(key, rule, dict(row["labels"]), row["run"])
                for name in EXPORTED_FIELDS:
                    if name in row:
                        setattr(inst, name, row[name])
                inst.state = AlertState(row["state"])
                inst.value = number_or_nan(row.get("value"))
                inst.fired_value = number_or_nan(row.get("fired_value"))
                if isinstance(rule, EventRule):
                    self._event_instances.setdefault((row["run"], int(row["rank"])), {})[key] = inst
                if row["run"] not in self._runs:
                    self._runs[row["run"]] = RunState(inst.since(), inst.step or 0)
        return gone

    # ---------------------------------------------------------------- snapshots

    def alerts(self, states: Iterable[AlertState] | None = None) -> list[Alert]:
        """Current non-inactive alerts (pending, firing, recently resolved)."""
        wanted = set(states) if states is not None else None
        with self._lock:
            return [
                inst.snapshot()
                for inst in self._instances.values()
                if inst.state is not AlertState.INACTIVE and (wanted is None or inst.state in wanted)
            ]

    def run_names(self) -> list[str]:
        """The runs the engine knows (reported within ``run_ttl``)."""
        with self._lock:
            return list(self._runs)

    def firing(self) -> list[Alert]:
        """Alerts firing now."""
        return self.alerts([AlertState.FIRING])

    def __iter__(self) -> Iterator[Alert]:
        return iter(self.alerts())
