"""The evaluation engine: one state machine per (rule, series), fed report by report.

States (:mod:`trainvitals.alerts.state`): inactive -> pending -> firing ->
resolved (-> pending/firing again).

- One alert's moves (``for_steps``/``for`` before firing, hysteresis back to
  ``clear``, ``hold_steps``/``hold``): :mod:`trainvitals.alerts.transitions`.
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
  since the last such event. A ``run_end`` event ends a run (until a later report
  of it without one: :func:`trainvitals.wire.ends_run`): RunSilent stays quiet for
  it while it has ended, and its firing alerts resolve with the reason
  (``run r ended at step s``; pending ones are dropped) unless the engine was built
  with ``resolve_on_run_end=False`` (a replay judging what fired up to the end).
- Timers (``tick``): RunSilent, holds in seconds, forgetting runs silent for
  ``run_ttl`` (their alerts resolve) and dropping resolved alerts after
  ``resolved_retention``.

The engine takes rule objects (:func:`trainvitals.alerts.loading.resolve_rules`
turns names, files and folders into them) and indexes them
(:mod:`trainvitals.alerts.rule_index`); the alerts it holds, bounded per rule and
run, are :mod:`trainvitals.alerts.alert_table`'s; their persisted form (export and
restore across a restart) is :mod:`trainvitals.alerts.engine_state`'s. Pure
Python; thread-safe (one lock); no I/O.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from trainvitals.alerts.alert_table import DEFAULT_MAX_ALERTS_PER_RULE, AlertKey, AlertTable
from trainvitals.alerts.conditions import LatestSamples
from trainvitals.alerts.engine_state import RunRow, export_alerts, export_runs, restore
from trainvitals.alerts.instances import RunState
from trainvitals.alerts.model import Rule
from trainvitals.alerts.rule_index import CompiledRule, RuleIndex
from trainvitals.alerts.state import Alert, AlertState, Transition
from trainvitals.alerts.transforms import SeriesHistory
from trainvitals.alerts.transitions import BAD, CLEAR, UNKNOWN, advance, fire, hold_done, resolve, threshold_verdict
from trainvitals.wire import ends_run, series_labels
from trainvitals.wire.coverage import coverage_samples
from trainvitals.wire.views import ReportView

__all__ = ["DEFAULT_MAX_ALERTS_PER_RULE", "Engine"]


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
        self._index = index = RuleIndex(rules)
        self.rules: list[Rule] = index.rules
        self.max_alerts_per_rule = max_alerts_per_rule
        # A run that ends resolves its alerts; resolve_on_run_end=False keeps what was still
        # firing at its end (a replay that judges a finished run's reports).
        self.resolve_on_run_end = resolve_on_run_end
        self.run_ttl = run_ttl
        self.resolved_retention = resolved_retention
        self._lock = threading.Lock()
        self._table = table = AlertTable(len(self.rules), max_alerts_per_rule)
        self.suppressed: dict[str, int] = table.suppressed
        """Alerts not opened past ``max_alerts_per_rule``, by alert name."""
        # The table's own dict and list: one attribute lookup less on the ingest path.
        self._instances = table.instances
        self._live = table.live
        # What `and` conditions read: the latest report's samples of their metrics.
        self._latest = LatestSamples()
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
        index = self._index
        with self._lock:
            info = self._runs.get(run)
            if info is None:
                self._runs[run] = info = RunState(now, step)
            else:
                info.last_seen = max(info.last_seen, now)
                info.last_step = step
            self._dirty_runs.add(run)
            ended = info.ended = ends_run(report)
            for i, _rule in index.silence:
                inst = self._instances.get((i, run, 0, ()))
                if inst is not None and inst.state is AlertState.FIRING:
                    inst.value = 0.0
                    out.append(resolve(inst, now, f"run {run} reported again at step {step}"))

            # First pass: remember values that `and` conditions look up, and the
            # samples some rule watches; evaluate once the whole report is known.
            matched: list[tuple[CompiledRule, Any]] = []
            fresh: dict[str, list[Any]] = {}
            interest_get = index.interest.get
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

            if index.has_events:
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
                out.append(resolve(inst, now, reason))
            elif inst.state is AlertState.PENDING:
                inst.state = AlertState.INACTIVE
                self._table.drop(key, inst)
        return out

    def _evaluate(
        self, c: CompiledRule, run: str, rank: int, step: int, labels: Mapping[str, str], raw: float, now: float
    ) -> Transition | None:
        """One sample of a threshold rule: judge it (with the rule's ``and`` conditions)
        and advance its series' alert."""
        rule = c.rule
        items = tuple(sorted(labels.items()))
        key = (c.index, run, rank, items)
        value = self._history.apply(rule, key, raw) if rule.transform != "value" else raw
        verdict = threshold_verdict(rule, value)
        inst = self._instances.get(key)
        if c.conditions and verdict != UNKNOWN:
            if inst is None and not self._latest.seen_all(c.conditions, run, rank):
                # No state, and a condition's metric not reported yet: the conditions cannot
                # all hold, so nothing can start (the cheap path of a healthy run).
                return None
            holds = self._latest.verdict(c.conditions, run, rank, labels)
            if holds is False:  # a condition clearly false counts as cleared
                verdict = CLEAR
            elif holds is None and verdict == BAD:
                verdict = UNKNOWN
        if verdict == UNKNOWN or (inst is None and verdict != BAD):
            if inst is not None and value is not None and value == value and inst.state is not AlertState.RESOLVED:
                inst.value = value
            return None
        if inst is None:
            inst = self._table.bounded(key, rule, labels, run, rank)
            if inst is None:
                return None
        t = advance(inst, verdict, value, step, now)  # type: ignore[arg-type]
        if t is not None and t.state is AlertState.INACTIVE:  # a pending one that did not last
            self._table.drop(inst.key, inst)
        return t

    def _observe_events(self, report: ReportView, now: float) -> list[Transition]:
        """Event rules: fire on the report carrying the event; resolve on a later report of
        the run without one, once ``hold_steps``/``hold`` have passed since the last."""
        out: list[Transition] = []
        run, rank, step = report.run, report.rank, report.step
        table = self._table
        per_run = table.event_instances.setdefault((run, rank), {})
        seen: set[tuple[Any, ...]] = set()
        for ev in report.events:
            for i, rule, match in self._index.by_event.get(ev.kind, ()):
                if not match(ev.labels):
                    continue
                items = tuple(sorted(ev.labels.items()))
                key = (i, run, rank, items)
                seen.add(key)
                inst = self._instances.get(key)
                if inst is None:
                    inst = table.bounded(key, rule, ev.labels, run, rank)
                    if inst is None:
                        continue
                    per_run[key] = inst
                inst.step, inst.detail = step, ev.detail
                inst.clear_step, inst.clear_time = step, now
                if inst.state is AlertState.FIRING:
                    inst.value += 1
                    continue
                inst.value, inst.pending_step = 1.0, step
                per_run[key] = inst
                out.append(fire(inst, 1.0, now))
        for key, inst in list(per_run.items()):
            if key in seen or inst.state is not AlertState.FIRING:
                continue
            if step < (inst.clear_step or 0):
                inst.clear_step = step
            if hold_done(inst.rule, inst, step, now):
                inst.step = step
                out.append(resolve(inst, now))
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
                if info.ended:
                    continue
                for i, rule in self._index.silence:
                    if silent < rule.silent_for:
                        continue
                    key: AlertKey = (i, run, 0, ())
                    inst = self._instances.get(key)
                    if inst is None:
                        inst = self._table.new(key, rule, series_labels(run, 0, {}), run)
                    inst.value, inst.step = silent, info.last_step
                    if inst.state is not AlertState.FIRING:
                        out.append(fire(inst, silent, now))
            # Holds measured in seconds can end without a report.
            for inst in self._instances.values():
                inst_rule = inst.rule
                if (
                    inst.state is AlertState.FIRING
                    and getattr(inst_rule, "hold", 0.0) > 0
                    and inst.clear_time is not None
                    and hold_done(inst_rule, inst, inst.step, now)
                ):
                    out.append(resolve(inst, now))
            if now >= self._next_sweep:
                self._next_sweep = now + min(10.0, self.resolved_retention)
                for key, inst in list(self._instances.items()):
                    if (
                        inst.state is AlertState.RESOLVED
                        and inst.resolved_at is not None
                        and now - inst.resolved_at >= self.resolved_retention
                    ):
                        self._table.drop(key, inst)
        return out

    def forget_run(self, run: str, now: float) -> list[Transition]:
        """Forget ``run`` now, as a run silent for ``run_ttl`` is (its firing alerts
        resolve, saying so); nothing when the engine does not know it."""
        with self._lock:
            return self._forget_run(run, now) if run in self._runs else []

    def _forget_run(self, run: str, now: float) -> list[Transition]:
        """A run silent for ``run_ttl``: its firing alerts resolve (saying so), all go."""
        out = []
        for key, inst in list(self._instances.items()):
            if inst.run != run:
                continue
            if inst.state is AlertState.FIRING:
                out.append(resolve(inst, now, f"run {run} sent nothing for {self.run_ttl:.0f} s and was forgotten"))
            self._table.drop(key, inst)
        self._history.forget_run(run)
        self._latest.forget_run(run)
        self._table.forget_run(run)
        del self._runs[run]
        self._dirty_runs.add(run)
        return out

    # ------------------------------------------------------------- persistence

    def export_runs(self, dirty: bool = False) -> list[RunRow]:
        """``(run, last_seen, last_step, ended)`` per run; ``dirty``: only the runs changed
        since the last such call, a forgotten run as ``(run, None, None, None)``
        (:mod:`trainvitals.alerts.engine_state`)."""
        with self._lock:
            names = list(self._dirty_runs) if dirty else list(self._runs)
            if dirty:
                self._dirty_runs.clear()
            return export_runs(self._runs, names)

    def export_alerts(self) -> list[dict[str, Any]]:
        """Every pending, firing and recently resolved alert as a JSON-ready dict
        (what :meth:`restore` takes after a restart)."""
        with self._lock:
            return export_alerts(self._table)

    def restore(
        self, runs: Iterable[tuple[str, float, int, bool]], alerts: Iterable[Mapping[str, Any]]
    ) -> list[Mapping[str, Any]]:
        """Bring back runs and alerts from before a restart; return the alerts whose rule
        is gone (their state cannot go on; the caller resolves them downstream).

        A run comes back with its last report time, so RunSilent covers a run that
        went silent across the restart; an alert with its state, so a firing one
        resolves when its series clears and does not fire (page) again while it holds.
        """
        with self._lock:
            return restore(self.rules, self._index.by_name, self._runs, self._table, runs, alerts)

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
