"""The verdict on a run in words: the log lines a job's close prints, the table of ``trainvitals check``.

:func:`format_verdict` writes one run's :class:`~trainvitals.alerts.verdict.RunVerdict`
as a headline and one line per incident with what to do; :func:`verdict_table` every
incident of every run as a plain-text table; :func:`format_value` a figure as both show
it; :func:`format_transition` one alert's move as the log line both the in-job
evaluator (:mod:`trainvitals.alerts.local`) and the collector's alert service write.
The verdict itself is computed in :mod:`trainvitals.alerts.verdict`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from trainvitals.alerts.state import AlertState, Transition
from trainvitals.alerts.verdict import RunVerdict

__all__ = ["checked_text", "format_transition", "format_value", "format_verdict", "verdict_table"]


def format_value(value: float) -> str:
    """A value as the tables and log lines show it (4 significant digits)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "nan"
    return f"{value:.4g}"


def format_transition(t: Transition, runbook: str | None = None) -> str:
    """One log line: ``GradientDilution firing at step 21 (value 17.0): <summary> {run=..., ...} runbook: ...``
    (``runbook``: the link to show, the collector's page; default the rule's own
    reference); a resolve reads as :meth:`~trainvitals.alerts.state.Alert.resolved_summary`."""
    if t.state is AlertState.RESOLVED:
        return t.resolved_summary()
    labels = ", ".join(f"{k}={v}" for k, v in t.labels.items())
    where = f" at step {t.step}" if t.step is not None else ""
    shown = ""
    if t.value == t.value:
        shown = f" (value {format_value(t.value)})"
    text = f"{t.alertname} {t.state.value}{where}{shown}: {t.summary} {{{labels}}}"
    if t.reason:
        text += f" ({t.reason})"
    if t.state is AlertState.FIRING and t.rule.runbook:
        text += f" runbook: {runbook or t.rule.runbook}"
    return text


_WHY_NOT = {
    "not_requested": "not requested",
    "no_optimizer_step": "no optimizer step",
    "no_input": "nothing reached it",
    "no_lm_head": "no LM head found",
    "head_bypassed": "no gradient reached the LM head",
    "logits_layout": "logits layout not understood",
    "not_cross_entropy": "not a plain cross-entropy loss",
    "logits_overwritten": "logits overwritten in place",
    "objective_scaled": "the objective scales its loss on purpose",
    "sharded": "sharded layout not handled",
    "failed": "failed",
    "not_adam": "no Adam moments",
    "no_parameters": "nothing to watch",
    "not_packed": "no packed rows",
    "withheld": "every figure withheld",
    "ranks_disagree": "data-parallel ranks disagreed",
}
"""A coverage reason in a few words, for the verdict's headline (the full detail is in
the coverage lines)."""


def checked_text(verdict: RunVerdict) -> str:
    """``checked: optimizer, params, adam, loss; not checked: probe (not requested), ...``:
    what the verdict rests on, and what it does not, with why."""
    checked, missing = verdict.checks()
    parts = [f"checked: {', '.join(checked) if checked else 'nothing'}"]
    if missing:
        parts.append("not checked: " + ", ".join(f"{name} ({_WHY_NOT.get(why, why)})" for name, why in missing))
    return "; ".join(parts)


def format_verdict(verdict: RunVerdict, *, report_file: str | None = None) -> list[str]:
    """The verdict as log lines: a headline that says what was checked and what was not
    (and why), then one line per incident and its fix."""
    steps = (
        f"steps {verdict.first_step}-{verdict.last_step}"
        if verdict.first_step is not None and verdict.first_step != verdict.last_step
        else f"step {verdict.last_step}"
    )
    where = f"; reports in {report_file}" if report_file else ""
    checks = checked_text(verdict)
    if not verdict.incidents:
        return [
            f"trainvitals verdict for run {verdict.name}: no incident in {verdict.reports} reports ({steps}); "
            f"{checks}{where}"
        ]
    pages = sum(i.severity == "page" for i in verdict.incidents)
    lines = [
        f"trainvitals verdict for run {verdict.name}: {len(verdict.incidents)} incident(s)"
        f"{f', {pages} of severity page' if pages else ''} in {verdict.reports} reports ({steps}); {checks}{where}"
    ]
    for i in verdict.incidents:
        state = (
            f"resolved at step {i.last_step}"
            if i.resolved
            else (
                f"still firing when the run ended at step {i.last_step}"
                if i.ended_firing
                else f"still firing at step {i.last_step}"
            )
        )
        where_labels = f" {{{i.where}}}" if i.labels else ""
        lines.append(
            f"  {i.severity.upper()} {i.alert}{where_labels}: fired at step {i.first_step}, {state}, "
            f"peak {format_value(i.peak)}: {i.summary}"
        )
        lines.append(f"    what to do: {i.action}")
    return lines


def verdict_table(verdicts: Iterable[RunVerdict]) -> str:
    """A plain-text table of every incident of every run (``trainvitals check``)."""
    rows = [("RUN", "ALERT", "SEVERITY", "SERIES", "FIRST", "LAST", "PEAK", "STATE", "WHAT TO DO")]
    quiet = []
    for v in verdicts:
        if not v.incidents:
            quiet.append(
                f"{v.name}: no incident in {v.reports} reports (steps {v.first_step}-{v.last_step}); {checked_text(v)}"
            )
        for i in v.incidents:
            rows.append(
                (
                    v.name,
                    i.alert,
                    i.severity,
                    i.where or "-",
                    str(i.first_step),
                    str(i.last_step),
                    format_value(i.peak),
                    "resolved" if i.resolved else "firing",
                    i.action,
                )
            )
    lines = []
    if len(rows) > 1:
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]) - 1)]
        for r in rows:
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths, strict=False)) + "  " + r[-1])
    return "\n".join(lines + quiet)
