"""Rules as a Prometheus rule file, with the same semantics where PromQL can express them.

- ``above``/``below`` -> ``trainvitals_<metric>{matchers} > x``.
- ``clear`` (hysteresis) -> the alert's own ``ALERTS`` series: once firing it
  stays while the value is past ``clear``
  (``m > 5 or (m > 3 and ignoring(alertname, alertstate, severity) ALERTS{...})``).
- ``and`` conditions -> ``and on(run, rank, <that metric's labels>) other < y``.
- ``for_steps`` -> ``for:`` in seconds, assuming ``step_seconds`` per optimizer
  step (Prometheus sees time, not steps); ``for`` is kept as is; the longer wins.
- ``hold_steps``/``hold`` -> ``keep_firing_for:`` (Prometheus >= 2.42).
- ``transform: increase`` and event rules -> ``increase(counter[W]) > x``.
- ``transform: ratio_to_median`` -> value over ``quantile_over_time(0.5, ...)``
  across ``window`` reports' worth of time (``window * report_every * step_seconds``).
- RunSilent -> ``time() - trainvitals_last_report_timestamp_seconds > s unless
  on(run) trainvitals_run_ended == 1``: a run whose last report carried a
  ``run_end`` event stays quiet, as in the collector.
- Templates: ``{value:.1f}`` -> ``{{ printf "%.1f" $value }}``, ``{modality}`` ->
  ``{{ $labels.modality }}``, ``{step}`` -> a query of ``trainvitals_step``.

What cannot be carried over is said in the file's comments.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable, Sequence
from typing import Any

import yaml

from trainvitals.alerts.model import (
    METRIC_LABELS,
    SERIES_LABELS,
    EventRule,
    Rule,
    SilenceRule,
    ThresholdRule,
    parse_duration,
)
from trainvitals.wire import PREFIX

__all__ = ["export_prometheus", "promql_template"]

_IGNORING = "ignoring(alertname, alertstate, severity)"
# The collector's per-run gauge: 1 when the run's last report carried run_end.
RUN_ENDED = "run_ended"


def _num(x: float) -> str:
    """A float as PromQL and YAML read it back exactly."""
    if x == int(x) and abs(x) < 1e15:
        return str(int(x))
    return repr(float(x))


def _duration(seconds: float) -> str:
    """Seconds as a Prometheus duration: ``20s``, ``3m20s``, ``1h``, ``500ms``."""
    ms = round(seconds * 1000)
    if ms % 1000:
        return f"{ms}ms"
    s = ms // 1000
    parts = []
    for unit, size in (("h", 3600), ("m", 60), ("s", 1)):
        if s >= size:
            parts.append(f"{s // size}{unit}")
            s %= size
    return "".join(parts) or "0s"


def _selector(metric: str, matchers: Iterable[Any]) -> str:
    inner = ", ".join(m.promql() for m in matchers)
    return f"{PREFIX}{metric}{{{inner}}}" if inner else f"{PREFIX}{metric}"


def promql_template(text: str, rule: Rule) -> str:
    """A Python format template as a Prometheus (Go) annotation template."""
    out = []
    for literal, name, spec, _conv in string.Formatter().parse(text):
        out.append(literal)
        if name is None:
            continue
        out.append(_field(name, spec or "", rule))
    return "".join(out)


def _field(name: str, spec: str, rule: Rule) -> str:
    if name == "value":
        m = re.fullmatch(r"\.(\d+)([fge])", spec)
        if m:
            return f'{{{{ printf "%.{m.group(1)}{m.group(2)}" $value }}}}'
        if re.fullmatch(r"\.\d+%", spec):
            return "{{ $value | humanizePercentage }}"
        if spec == "d":
            return '{{ printf "%.0f" $value }}'
        return "{{ $value }}"
    if name in ("above", "below", "clear") and isinstance(rule, ThresholdRule):
        value = {"above": rule.above, "below": rule.below, "clear": rule.clear_at}[name]
        return format(value, spec) if value is not None else "?"
    if name == "step":
        return '{{ with query (printf "trainvitals_step{run=%q}" $labels.run) }}{{ . | first | value }}{{ end }}'
    if name == "detail":
        return "(see the collector's /v1/alerts)"
    return f"{{{{ $labels.{name} }}}}"


class _Exporter:
    def __init__(
        self, *, step_seconds: float, report_every: int, increase_window: str, runbook_base_url: str | None
    ) -> None:
        if step_seconds <= 0 or report_every < 1:
            raise ValueError("step_seconds must be positive and report_every at least 1")
        self.step_seconds = step_seconds
        self.report_every = report_every
        self.increase_window = _duration(parse_duration(increase_window))
        self.runbook_base_url = runbook_base_url

    def rule(self, rule: Rule) -> tuple[dict[str, Any] | None, list[str]]:
        notes: list[str] = []
        out: dict[str, Any] = {"alert": rule.alert}
        if isinstance(rule, ThresholdRule):
            out["expr"] = self._threshold_expr(rule, notes)
            for_s = max(rule.for_steps * self.step_seconds, rule.for_)
            hold_s = max(rule.hold_steps * self.step_seconds, rule.hold)
            if rule.for_steps:
                notes.append(f"for_steps {rule.for_steps} -> for {_duration(for_s)} at {self.step_seconds:g} s/step")
            if rule.hold_steps:
                notes.append(f"hold_steps {rule.hold_steps} -> keep_firing_for {_duration(hold_s)}")
        elif isinstance(rule, EventRule):
            counter = rule.counter_metric
            if counter is None:
                return None, [f"event {rule.event!r} has no counter metric: not exported"]
            if rule.labels:
                notes.append("the event's label matchers do not apply to the counter: dropped")
            out["expr"] = f"increase({PREFIX}{counter}[{self.increase_window}]) > 0"
            notes.append(f"event {rule.event!r} -> an increase of {PREFIX}{counter} within {self.increase_window}")
            for_s = 0.0
            hold_s = max(rule.hold_steps * self.step_seconds, rule.hold)
            if rule.hold_steps:
                notes.append(f"hold_steps {rule.hold_steps} -> keep_firing_for {_duration(hold_s)}")
        else:
            assert isinstance(rule, SilenceRule)
            out["expr"] = (
                f"time() - {PREFIX}last_report_timestamp_seconds > {_num(rule.silent_for)}"
                f" unless on(run) {PREFIX}{RUN_ENDED} == 1"
            )
            notes.append(
                f"a run whose last report carried run_end ({PREFIX}{RUN_ENDED} == 1) stays quiet, as in the collector"
            )
            for_s = hold_s = 0.0
        if for_s > 0:
            out["for"] = _duration(for_s)
        if hold_s > 0:
            out["keep_firing_for"] = _duration(hold_s)
        out["labels"] = {"severity": rule.severity}
        annotations = {"summary": promql_template(rule.summary, rule)}
        if rule.description:
            annotations["description"] = promql_template(rule.description, rule)
        if rule.runbook:
            runbook = rule.runbook
            if self.runbook_base_url and not runbook.startswith(("http://", "https://")):
                runbook = self.runbook_base_url.rstrip("/") + "/" + runbook.lstrip("/")
            annotations["runbook_url"] = runbook
        out["annotations"] = annotations
        return out, notes

    def _threshold_expr(self, rule: ThresholdRule, notes: list[str]) -> str:
        sel = _selector(rule.metric, rule.labels)
        if rule.transform == "increase":
            value = f"increase({sel}[{self.increase_window}])"
            notes.append(f"counter increase between reports -> increase over {self.increase_window}")
        elif rule.transform == "ratio_to_median":
            window = _duration(rule.window * self.report_every * self.step_seconds)
            value = f"{sel} / quantile_over_time(0.5, {sel}[{window}])"
            notes.append(
                f"median of the last {rule.window} reports -> median over {window} "
                f"({self.report_every} steps/report at {self.step_seconds:g} s/step), current value included"
            )
        else:
            value = sel
        op = ">" if rule.above is not None else "<"
        expr = f"{value} {op} {_num(rule.threshold)}"
        if rule.clear is not None and rule.clear != rule.threshold:
            firing = f'ALERTS{{alertname="{rule.alert}", alertstate="firing"}}'
            expr = f"({expr} or ({value} {op} {_num(rule.clear)} and {_IGNORING} {firing}))"
            notes.append(f"hysteresis: once firing, stays while {op} {_num(rule.clear)} (ALERTS self-reference)")
        for cond in rule.and_:
            on = [*SERIES_LABELS, *METRIC_LABELS.get(cond.metric, ())]
            on += [m.name for m in cond.labels if m.name not in on]
            cop = ">" if cond.above is not None else "<"
            threshold = cond.above if cond.above is not None else cond.below
            expr += f" and on({', '.join(on)}) {_selector(cond.metric, cond.labels)} {cop} {_num(threshold)}"  # type: ignore[arg-type]
        return expr


_HEADER = """\
# Prometheus alerting rules generated by `trainvitals rules export --format prometheus`.
# Source: {sources}.
#
# The collector evaluates these rules itself, report by report; this file lets
# Prometheus evaluate the same rules on the scraped metrics. Differences:
# - Steps: Prometheus sees time. for_steps / hold_steps become `for` /
#   `keep_firing_for` assuming {step_seconds:g} s per optimizer step
#   (--step-seconds); spike windows assume a report every {report_every} steps
#   (--report-every). Set both for your job.
# - Hysteresis (`clear`): expressed through the alert's own ALERTS series, which
#   exists only in the Prometheus that evaluates the rule.
# - Counter increases and events: increase(counter[{window}]) > 0, which fires
#   within a scrape of the increase and stays up to {window}; the collector fires
#   on the report itself.
# - NaN: the collector keeps an alert's state on a NaN or a missing series;
#   PromQL compares NaN as false, and a series that goes stale (5m) resolves.
# - keep_firing_for needs Prometheus >= 2.42.
"""


def export_prometheus(
    rules: Sequence[Rule],
    *,
    step_seconds: float = 1.0,
    report_every: int = 10,
    increase_window: str = "5m",
    runbook_base_url: str | None = None,
    group: str = "trainvitals",
    sources: str = "the default rules",
) -> str:
    """The rules as a Prometheus rule file (YAML text with explanatory comments)."""
    ex = _Exporter(
        step_seconds=step_seconds,
        report_every=report_every,
        increase_window=increase_window,
        runbook_base_url=runbook_base_url,
    )
    lines = [
        _HEADER.format(sources=sources, step_seconds=step_seconds, report_every=report_every, window=ex.increase_window)
    ]
    lines.append("groups:")
    lines.append(f"- name: {group}")
    lines.append("  rules:")
    exported = 0
    for rule in rules:
        body, notes = ex.rule(rule)
        lines.append(f"  # {rule.alert}" + (":" if notes else ""))
        lines.extend(f"  #   {note}" for note in notes)
        if body is None:
            continue
        exported += 1
        dumped = yaml.safe_dump([body], sort_keys=False, width=10_000, allow_unicode=True)
        lines.extend("  " + line for line in dumped.splitlines())
    if not exported:
        lines.append("  []")
    return "\n".join(lines) + "\n"
