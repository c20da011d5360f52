"""The verdict on a run: which alerts fired, when, how far, and what to do.

One computation for every place that says it: the job's close (``attach`` with
the rules evaluated in-process), ``trainvitals check`` over recorded reports and
the report page (``trainvitals report``, the collector's ``/runs/{run}``).

A :class:`VerdictBuilder` runs an :class:`~trainvitals.alerts.engine.Engine` over
reports in their order and keeps, per run, the number of reports and steps seen
and one :class:`Incident` per alert series that fired: the step it fired at, the
last step it was still firing (or the step it resolved), its peak value (the
highest for an ``above`` rule, the lowest for a ``below`` one, in the rule's
unit) and a line of what to do (the first sentence of the runbook's "Fix").
RunSilent rules are left out: a file of reports, or a job that is reporting, is
not silent. Pure Python, no torch, no I/O besides reading the runbooks once.
The verdict in words (log lines, the ``check`` table) is
:mod:`trainvitals.alerts.verdict_text`'s; reading recorded reports,
:mod:`trainvitals.wire.report_files`'.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from operator import attrgetter
from typing import Any

from trainvitals.alerts.engine import Engine
from trainvitals.alerts.loading import RuleSpec, resolve_rules
from trainvitals.alerts.model import Rule, SilenceRule, ThresholdRule
from trainvitals.alerts.state import Alert, AlertState, Transition
from trainvitals.alerts.templates import render_template
from trainvitals.wire import METRICS, Report, ends_run
from trainvitals.wire.coverage import NOT_APPLICABLE, NOT_BLIND, REASONS, SIGNALS
from trainvitals.wire.signals import SignalNames, metric_groups

__all__ = ["Incident", "RunVerdict", "VerdictBuilder", "action_for", "runbook_fix"]

SEVERITY_ORDER = {"page": 0, "warning": 1, "info": 2}
_name = attrgetter("name")

SIGNAL_GROUPS = SignalNames(lambda s: s.group is not None)
"""The signals whose figures coverage counts, as the metric catalogue groups them (the
registry's signals with a ``group``; ``optimizer``, ``params``, ``adam``, ``loss``,
``softmax`` built in). Listed in the catalogue's order by :func:`_signal_groups`."""


def _signal_groups() -> list[str]:
    return [s.group for s in metric_groups() if s.group is not None]


def _group_of(metric: str) -> str | None:
    spec = METRICS.get(metric)
    return spec.group if spec is not None and spec.group in SIGNAL_GROUPS else None


@lru_cache(maxsize=1)
def _runbook_fixes() -> dict[str, str]:
    """Alert name -> the first sentence of its runbook's **Fix.** paragraph."""
    try:
        text = resources.files("trainvitals.alerts").joinpath("RUNBOOKS.md").read_text(encoding="utf-8")
    except OSError:
        return {}
    out: dict[str, str] = {}
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        name, _, body = section.partition("\n")
        m = re.search(r"\*\*Fix\.\*\*\s*(.+?)(?:\n\s*\n|\Z)", body, flags=re.S)
        if not m:
            continue
        para = " ".join(m.group(1).split())
        sentence = re.split(r"(?<=[.!?])\s+(?=[A-Z`(])", para, maxsplit=1)[0]
        out[name.strip()] = sentence
    return out


def action_for(rule: Rule, alert: Alert | None = None) -> str:
    """One line of what to do about ``rule``: its runbook's fix, else the first sentence of
    its description (or summary), rendered with ``alert``'s labels and value (a template
    field no alert fills reads ``?``, never a raw ``{value:.1f}``)."""
    fix = _runbook_fixes().get(rule.alert)
    if fix:
        return fix
    template = rule.description or rule.summary or ""
    text = render_template(template, alert.fields() if alert is not None else {})
    text = " ".join(text.split())
    return text.split(". ")[0].rstrip(".") + "." if text else f"see the runbook of {rule.alert}"


@dataclass
class Incident:
    """One alert series that fired in a run."""

    run: str
    alert: str
    severity: str
    labels: dict[str, str]
    """The series' labels other than ``run`` (``modality``, ``param``, ``objective`` ...)."""
    first_step: int
    """The step of the report it fired on."""
    last_step: int
    """The last step it was still firing, or the step it resolved at."""
    peak: float
    summary: str
    """The rule's summary rendered with the peak value."""
    action: str
    runbook: str
    metric: str | None
    """The metric the rule watches (None for event rules)."""
    above: float | None = None
    below: float | None = None
    clear: float | None = None
    resolved: bool = False
    """Its value cleared (False: it was still firing at the last report)."""
    ended_firing: bool = False
    """The run ended (or expired) while it fired."""
    fired: int = 1
    """How many times it fired (a series that resolved and fired again stays one incident)."""

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["peak"] = self.peak if math.isfinite(self.peak) else None
        return out

    @property
    def where(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.labels.items())


@dataclass
class RunVerdict:
    """What a run's reports say."""

    run: str
    reports: int = 0
    first_step: int | None = None
    last_step: int | None = None
    ended: bool = False
    """The run has ended: its latest report carried ``run_end`` (the job closed its
    monitor; :func:`~trainvitals.wire.ends_run`)."""
    incidents: list[Incident] = field(default_factory=list)
    source: str | None = None
    """The file the reports came from, where the same run name is in several files
    (``trainvitals check a.jsonl b.jsonl`` judges each apart)."""
    coverage: dict[str, int] = field(default_factory=dict)
    signals: dict[str, dict[str, Any]] = field(default_factory=dict)
    """What the reports' coverage entries said per built-in signal
    (:mod:`trainvitals.wire.coverage`): ``active`` (reports it was active in), ``reports``
    (reports that said), and the last inactive ``reason`` and ``detail``; empty for
    reports from before coverage."""
    """Reports that carried figures of each signal (``optimizer``, ``loss``, ``params``,
    ``adam``, ``softmax``: the metric catalogue's groups); a signal absent here was never
    seen in this run's reports."""

    @property
    def name(self) -> str:
        """The run's name as the verdict shows it: ``RUN [FILE]`` when ``source`` is set."""
        return f"{self.run} [{self.source}]" if self.source else self.run

    @property
    def paged(self) -> bool:
        """An alert of severity ``page`` fired."""
        return any(i.severity == "page" for i in self.incidents)

    @property
    def firing(self) -> list[Incident]:
        return [i for i in self.incidents if not i.resolved]

    def as_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            **({"file": self.source} if self.source else {}),
            "reports": self.reports,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "ended": self.ended,
            "paged": self.paged,
            "incidents": [i.as_dict() for i in self.incidents],
            "coverage": dict(self.coverage),
            "signals": {k: dict(v) for k, v in self.signals.items()},
        }

    def checks(self) -> tuple[list[str], list[tuple[str, str]]]:
        """What the verdict rests on: the signals that carried figures (active in at
        least one report), and the others with their reason (the reports' coverage;
        for reports from before coverage, the signal groups that carried no figure)."""
        checked: list[str] = []
        missing: list[tuple[str, str]] = []
        if self.signals:
            for name in SIGNALS:
                sig = self.signals.get(name)
                if sig is None:
                    continue
                if sig["active"]:
                    checked.append(name)
                elif sig["reason"] in NOT_APPLICABLE:
                    continue  # nothing of its kind in the job (no packed rows): no check to speak of
                else:
                    missing.append((name, sig["reason"] or "no_input"))
            return checked, missing
        for group in _signal_groups():
            if self.coverage.get(group, 0):
                checked.append(group)
            else:
                missing.append((group, "no_input"))
        return checked, missing

    def coverage_lines(self) -> list[str]:
        """What was watched, per built-in signal: in how many reports it was active, and
        why not where it was not (the reports' coverage entries; for reports from before
        coverage, which reports carried its figures)."""
        out = []
        if self.signals:
            for name in SIGNALS:
                sig = self.signals.get(name)
                if sig is None:
                    continue
                if sig["active"]:
                    line = f"  {name}: active in {sig['active']} of {sig['reports']} reports"
                    if sig["reason"] and sig["active"] < sig["reports"]:
                        line += f" (else {sig['reason']})"
                else:
                    blind = "" if sig["reason"] in NOT_BLIND else "NOT WATCHED: "
                    why = REASONS.get(sig["reason"] or "", "")
                    line = f"  {name}: {blind}{sig['reason']}: {sig['detail'] or why}"
                out.append(line)
            return out
        for group in _signal_groups():
            n = self.coverage.get(group, 0)
            out.append(
                f"  {group}: figures in {n} of {self.reports} reports"
                if n
                else f"  {group}: no figures in any report (not watched)"
            )
        return out


class VerdictBuilder:
    """Feed reports in order (:meth:`observe`); read :meth:`verdicts` at any time.

    ``rules``: what :func:`~trainvitals.alerts.loading.resolve_rules` takes, or rule
    objects already resolved. ``now`` defaults to each report's own ``time``, so a
    recorded file is judged as it was lived (``for``/``hold`` in seconds included).
    """

    def __init__(self, rules: RuleSpec = "default", *, engine: Engine | None = None) -> None:
        # ``engine``: an engine another owner feeds (the collector's alerts), whose
        # transitions come in through record(); the rules are evaluated once, not twice.
        self._fed = engine is not None
        if engine is None:
            resolved = resolve_rules(rules)
            self.rules = [r for r in resolved if not isinstance(r, SilenceRule)]
            engine = Engine(self.rules, run_ttl=math.inf, resolved_retention=math.inf)
        else:
            self.rules = [r for r in engine.rules if not isinstance(r, SilenceRule)]
        self.engine = engine
        self._runs: dict[str, RunVerdict] = {}
        self._incidents: dict[tuple[str, tuple[Any, ...]], Incident] = {}

    def observe(self, report: Report, now: float | None = None) -> list[Transition]:
        """Evaluate one report; return the engine's transitions (for log lines)."""
        if self._fed:
            raise RuntimeError("this VerdictBuilder reads a shared engine: record() what its owner observed")
        now = report.time if now is None else now
        transitions = self.engine.observe(report, now)
        transitions.extend(self.engine.tick(now))
        self.record(report, transitions)
        return transitions

    def record(self, report: Any, transitions: Iterable[Transition]) -> None:
        """A report and the transitions its evaluation caused (``report`` None: timer
        transitions of the engine's tick). With a shared engine, RunSilent transitions
        are left out, as a builder's own engine has no such rules."""
        if self._fed:
            transitions = [t for t in transitions if not isinstance(t.rule, SilenceRule)]
        if report is None:
            for t in transitions:
                self._transition(t)
            return
        run = self._runs.get(report.run)
        if run is None:
            run = self._runs[report.run] = RunVerdict(report.run)
        if report.samples:
            run.reports += 1
            # the distinct names first (C speed), then their groups
            for group in {_group_of(name) for name in set(map(_name, report.samples))}:
                if group is not None:
                    run.coverage[group] = run.coverage.get(group, 0) + 1
        run.first_step = report.step if run.first_step is None else min(run.first_step, report.step)
        run.last_step = report.step if run.last_step is None else max(run.last_step, report.step)
        run.ended = ends = ends_run(report)
        if not ends and report.samples:  # the run_end report repeats the last coverage: counted once
            for entry in getattr(report, "coverage", None) or ():
                sig = run.signals.get(entry.signal)
                if sig is None:
                    sig = run.signals[entry.signal] = {"active": 0, "reports": 0, "reason": None, "detail": ""}
                sig["reports"] += 1
                if entry.active:
                    sig["active"] += 1
                else:
                    sig["reason"], sig["detail"] = entry.reason, entry.detail
        for t in transitions:
            self._transition(t)
        if self._incidents:
            for alert in self.engine.firing():
                if alert.step == report.step and alert.labels.get("run") == report.run:
                    self._update(alert)

    def _key(self, alert: Alert) -> tuple[str, tuple[Any, ...]]:
        return alert.alertname, tuple(sorted(alert.labels.items()))

    def _transition(self, t: Transition) -> None:
        key = self._key(t)
        inc = self._incidents.get(key)
        if t.state is AlertState.FIRING:
            if inc is None:
                rule = t.rule
                run = t.labels.get("run", "")
                inc = Incident(
                    run=run,
                    alert=rule.alert,
                    severity=rule.severity,
                    labels={k: v for k, v in t.labels.items() if k != "run"},
                    first_step=t.step if t.step is not None else 0,
                    last_step=t.step if t.step is not None else 0,
                    peak=t.value,
                    summary=t.summary,
                    action=action_for(rule, t),
                    runbook=rule.runbook or "",
                    metric=rule.metric if isinstance(rule, ThresholdRule) else None,
                )
                if isinstance(rule, ThresholdRule):
                    inc.above, inc.below, inc.clear = rule.above, rule.below, rule.clear_at
                self._incidents[key] = inc
                self._runs.setdefault(run, RunVerdict(run)).incidents.append(inc)
            else:
                inc.fired += 1
                inc.resolved = inc.ended_firing = False
            self._update(t)
        elif t.state is AlertState.RESOLVED and inc is not None:
            # Resolved because the run ended (or expired), not because the value cleared:
            # it was still firing when the run stopped.
            ended = getattr(t, "resolved_reason", "") or t.reason
            inc.resolved = not ended
            inc.ended_firing = bool(ended)
            if t.step is not None:
                inc.last_step = max(inc.last_step, t.step)

    def _update(self, alert: Alert) -> None:
        inc = self._incidents.get(self._key(alert))
        if inc is None:
            return
        if alert.step is not None:
            inc.last_step = max(inc.last_step, alert.step)
        value = alert.value
        if value != value:
            return
        worse = value < inc.peak if inc.below is not None else value > inc.peak
        if inc.peak != inc.peak or worse:
            inc.peak = value
            inc.summary = _summary_at(alert, value)

    def forget(self, run: str, now: float) -> None:
        """Drop everything about ``run`` (a bounded consumer, the collector's pages); a
        shared engine keeps its own state of the run (its owner decides)."""
        if not self._fed:
            self.engine.forget_run(run, now)
        self._runs.pop(run, None)
        for key in [k for k, inc in self._incidents.items() if inc.run == run]:
            del self._incidents[key]

    def verdicts(self) -> list[RunVerdict]:
        """One verdict per run seen, incidents page first, then by the step they fired."""
        out = []
        for v in self._runs.values():
            v.incidents.sort(key=lambda i: (SEVERITY_ORDER.get(i.severity, 9), i.first_step, i.alert))
            out.append(v)
        return out

    def verdict(self, run: str) -> RunVerdict:
        for v in self.verdicts():
            if v.run == run:
                return v
        return RunVerdict(run)


def _summary_at(alert: Alert, value: float) -> str:
    from dataclasses import replace

    try:
        return replace(alert, value=value, fired_value=value, state=AlertState.FIRING).summary
    except Exception:  # noqa: BLE001 - a template that cannot render keeps the last text
        return alert.summary


def runbook_fix(alert: str) -> str | None:
    """The first sentence of ``alert``'s runbook **Fix.** paragraph, if it has one."""
    return _runbook_fixes().get(alert)
