"""One alert's state record in the engine, one run's, and their persisted form.

:class:`AlertInstance` is the state of one (rule, series) pair that the engine's state
machines (:mod:`trainvitals.alerts.engine`) advance; :func:`export_row` writes it as the
JSON-ready row the collector's state file keeps, and :data:`EXPORTED_FIELDS` names the
fields a restart brings back (``Engine.restore``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainvitals.alerts.model import Rule
from trainvitals.alerts.state import Alert, AlertState

__all__ = ["EXPORTED_FIELDS", "AlertInstance", "RunState", "export_row", "number_or_nan", "rule_index_of"]


@dataclass(eq=False)
class AlertInstance:
    rule: Rule
    index: int
    labels: dict[str, str]
    run: str
    key: tuple
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

    def snapshot(self, cls: type[Alert] = Alert, **extra: Any) -> Any:
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
    closed: bool = False


EXPORTED_FIELDS = (
    "step",
    "pending_step",
    "pending_time",
    "fired_at",
    "resolved_at",
    "clear_step",
    "clear_time",
    "detail",
    "reason",
)


def number_or_nan(v: Any) -> float:
    return math.nan if v is None else float(v)


def export_row(key: tuple, inst: AlertInstance) -> dict[str, Any]:
    """One instance as a JSON-ready dict (NaN as None)."""
    out: dict[str, Any] = {
        "alertname": inst.rule.alert,
        "rule_index": key[0],
        "run": key[1],
        "rank": key[2],
        "items": [list(kv) for kv in key[3]],
        "labels": dict(inst.labels),
        "state": inst.state.value,
        "value": inst.value if math.isfinite(inst.value) else None,
        "fired_value": inst.fired_value if math.isfinite(inst.fired_value) else None,
    }
    for name in EXPORTED_FIELDS:
        out[name] = getattr(inst, name)
    return out


def rule_index_of(rules: list[Rule], by_name: Mapping[str, list[int]], row: Mapping[str, Any]) -> int | None:
    """The rule a persisted alert belongs to now: same name (and index, when rules were reordered)."""
    candidates = by_name.get(row["alertname"], [])
    if not candidates:
        return None
    index = row.get("rule_index")
    return index if index in candidates else candidates[0]
