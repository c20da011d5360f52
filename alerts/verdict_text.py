"""The verdict on a run in words: the log lines a job's close prints, the table of ``trainvitals check``.

:func:`format_verdict` writes one run's :class:`~trainvitals.alerts.verdict.RunVerdict`
as a headline and one line per incident with what to do; :func:`verdict_table` every
incident of every run as a plain-text table; :func:`format_value` a figure as both show
it. The verdict itself is computed in :mod:`trainvitals.alerts.verdict`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from trainvitals.alerts.verdict import RunVerdict

__all__ = ["format_value", "format_verdict", "verdict_table"]


def format_value(value: float) -> str:
    """A value as the tables and log lines show it (4 significant digits)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "nan"
    return f"{value:.4g}"


def format_verdict(verdict: RunVerdict, *, report_file: str | None = None) -> list[str]:
    """The verdict as log lines: a headline, then one line per incident and its fix."""
    steps = (
        f"steps {verdict.first_step}-{verdict.last_step}"
        if verdict.first_step is not None and verdict.first_step != verdict.last_step
        else f"step {verdict.last_step}"
    )
    where = f"; reports in {report_file}" if report_file else ""
    if not verdict.incidents:
        return [f"trainvitals verdict for run {verdict.run}: no incident in {verdict.reports} reports ({steps}){where}"]
    pages = sum(i.severity == "page" for i in verdict.incidents)
    lines = [
        f"trainvitals verdict for run {verdict.run}: {len(verdict.incidents)} incident(s)"
        f"{f', {pages} of severity page' if pages else ''} in {verdict.reports} reports ({steps}){where}"
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
            quiet.append(f"{v.run}: no incident in {v.reports} reports (steps {v.first_step}-{v.last_step})")
        for i in v.incidents:
            rows.append(
                (
                    v.run,
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
