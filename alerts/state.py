"""What the engine reports: the state of one (rule, series) and its changes.

States: inactive -> pending -> firing -> resolved (-> pending/firing again).
:class:`Alert` is a frozen snapshot of one state machine, :class:`Transition`
one change of state; both render the rule's summary and description over the
series' labels and the rule's numbers (:mod:`trainvitals.alerts.templates`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from trainvitals.alerts.model import EventRule, Rule, SilenceRule, ThresholdRule
from trainvitals.alerts.templates import render_template

__all__ = ["Alert", "AlertState", "LabelItems", "Transition", "format_duration"]

LabelItems = tuple[tuple[str, str], ...]
"""A series' labels as sorted (name, value) pairs: hashable, order-independent."""


class AlertState(str, Enum):
    """Where one (rule, series) stands."""

    INACTIVE = "inactive"
    PENDING = "pending"
    FIRING = "firing"
    RESOLVED = "resolved"


@dataclass(frozen=True)
class Alert:
    """A snapshot of one (rule, series) state machine.

    ``value`` is the (transformed) value last evaluated, in the metric's unit; for
    event rules the number of events while firing, for RunSilent the seconds
    since the run's last report. ``since``, ``fired_at`` and ``resolved_at`` are
    Unix seconds of the engine's clock.
    """

    rule: Rule
    labels: Mapping[str, str]
    state: AlertState
    value: float
    step: int | None
    since: float
    fired_at: float | None
    resolved_at: float | None
    detail: str = ""
    fired_value: float = float("nan")
    """The value when it fired: what a resolved alert's text is rendered with (the value
    at resolution would read "image gets 1.0x less gradient")."""
    resolved_reason: str = ""
    """Why a resolved alert resolved when its value did not clear it ("run r ended at step
    40"); empty when the value cleared."""

    @property
    def alertname(self) -> str:
        return self.rule.alert

    @property
    def severity(self) -> str:
        return self.rule.severity

    @property
    def alert_labels(self) -> dict[str, str]:
        """Labels that identify the alert downstream: alertname, severity and the series'."""
        return {"alertname": self.rule.alert, "severity": self.rule.severity, **self.labels}

    @property
    def key(self) -> tuple[str, LabelItems]:
        return self.rule.alert, tuple(sorted(self.labels.items()))

    def fields(self) -> dict[str, Any]:
        """Template namespace: the series labels plus the rule's numbers."""
        out: dict[str, Any] = dict(self.labels)
        value = self.value
        if self.state is AlertState.RESOLVED and self.fired_value == self.fired_value:
            value = self.fired_value
        out.update(
            alertname=self.rule.alert,
            severity=self.rule.severity,
            value=value,
            step=self.step if self.step is not None else -1,
            detail=self.detail,
        )
        if isinstance(self.rule, ThresholdRule):
            out.update(above=self.rule.above, below=self.rule.below, clear=self.rule.clear_at)
        return out

    @property
    def summary(self) -> str:
        return render_template(self.rule.summary, self.fields())

    @property
    def description(self) -> str:
        return render_template(self.rule.description, self.fields())

    def series_text(self) -> str:
        """``run mm-pt1 (modality=image)``: which series, in words."""
        rest = ", ".join(f"{k}={v}" for k, v in self.labels.items() if k != "run")
        run = self.labels.get("run", "?")
        return f"run {run}" + (f" ({rest})" if rest else "")

    def resolved_summary(self, now: float | None = None) -> str:
        """What a resolved notice says: why it resolved (the value it cleared at, or the run
        ended), and how long it fired."""
        end = self.resolved_at if self.resolved_at is not None else now
        fired = ""
        if self.fired_at is not None and end is not None:
            fired = f" after firing for {format_duration(end - self.fired_at)}"
        head = f"Resolved: {self.rule.alert} in {self.series_text()}"
        rule = self.rule
        if self.resolved_reason:
            last = f"; last value {_figure(self.value)}" if isinstance(rule, ThresholdRule) else ""
            return f"{head}: {self.resolved_reason}{fired}{last}"
        at = f" at step {self.step}" if self.step is not None else ""
        if isinstance(rule, ThresholdRule):
            side = f"<= {_figure(rule.clear_at)}" if rule.above is not None else f">= {_figure(rule.clear_at)}"
            return (
                f"{head}{at}: {rule.metric} is back to {_figure(self.value)} (clears at {side}){fired}; "
                f"it fired at {_figure(self.fired_value)}"
            )
        if isinstance(rule, EventRule):
            return f"{head}{at}: no new {rule.event} event for {rule.hold_steps} steps{fired}"
        if isinstance(rule, SilenceRule):
            return f"{head}{at}: the run reports again{fired}"
        return f"{head}{at}{fired}"

    def resolved_description(self) -> str:
        """The firing text, marked as what was true while it fired."""
        text = self.summary
        if self.description:
            text += ". " + self.description
        return f"While it fired: {text}"


@dataclass(frozen=True)
class Transition(Alert):
    """A state change of one (rule, series): ``old`` -> ``state``."""

    old: AlertState = AlertState.INACTIVE
    reason: str = ""

    @property
    def new(self) -> AlertState:
        return self.state


def _figure(value: float) -> str:
    return "?" if value != value else f"{value:.4g}"


def format_duration(seconds: float) -> str:
    """``45 s``, ``12 min 5 s``, ``3 h 20 min``, ``2 d 4 h``: a span an on-call reads at once."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m} min {s} s" if s else f"{m} min"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h} h {m} min" if m else f"{h} h"
    d, h = divmod(h, 24)
    return f"{d} d {h} h" if h else f"{d} d"
