"""One alert's state record in the engine, and one run's.

:class:`AlertInstance` is the state of one (rule, series) pair that the state machine
(:mod:`trainvitals.alerts.transitions`) advances and the engine's table
(:mod:`trainvitals.alerts.alert_table`) holds; :class:`RunState` what the engine knows
of one run. Their persisted form is :mod:`trainvitals.alerts.engine_state`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypeVar

from trainvitals.alerts.model import Rule
from trainvitals.alerts.state import Alert, AlertState

_A = TypeVar("_A", bound=Alert)

__all__ = ["AlertInstance", "RunState"]


@dataclass(eq=False)
class AlertInstance:
    rule: Rule
    index: int
    labels: dict[str, str]
    run: str
    key: tuple[Any, ...]
    state: AlertState = AlertState.INACTIVE
    value: float = math.nan
    step: int | None = None
    pending_step: int = 0
    pending_time: float = 0.0
    fired_at: float | None = None
    resolved_at: float | None = None
    # Start of the current clear streak (threshold rules) or the last event (event rules).
    clear_step: int | None = None
    clear_time: float | None = None
    detail: str = ""
    fired_value: float = math.nan
    # Why it resolved when no value cleared it (the run ended, expired, reported again).
    reason: str = ""

    def since(self) -> float:
        if self.state is AlertState.FIRING and self.fired_at is not None:
            return self.fired_at
        if self.state is AlertState.RESOLVED and self.resolved_at is not None:
            return self.resolved_at
        return self.pending_time

    def snapshot(self, cls: type[_A] = Alert, **extra: Any) -> _A:  # type: ignore[assignment]  # mypy: default of a TypeVar-typed argument
        return cls(
            rule=self.rule,
            labels=dict(self.labels),
            state=self.state,
            value=self.value,
            step=self.step,
            since=self.since(),
            fired_at=self.fired_at,
            resolved_at=self.resolved_at,
            detail=self.detail,
            fired_value=self.fired_value,
            resolved_reason=self.reason,
            **extra,
        )


@dataclass(eq=False)
class RunState:
    last_seen: float
    last_step: int
    ended: bool = False
    """Whether the run has ended: its latest report ended it (:func:`~trainvitals.wire.ends_run`)."""
