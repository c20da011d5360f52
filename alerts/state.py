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

from trainvitals.alerts.model import Rule, ThresholdRule
from trainvitals.alerts.templates import render_template

__all__ = ["Alert", "AlertState", "LabelItems", "Transition"]

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


@dataclass(frozen=True)
class Transition(Alert):
    """A state change of one (rule, series): ``old`` -> ``state``."""

    old: AlertState = AlertState.INACTIVE
    reason: str = ""

    @property
    def new(self) -> AlertState:
        return self.state
