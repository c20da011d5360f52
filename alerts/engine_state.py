"""The engine's state in the form that survives a restart: export and restore.

The collector's state file (an :class:`~trainvitals.alerts.persistence.AlertPersistence`)
keeps what :func:`export_runs` and :func:`export_alerts` give, and
:func:`restore` brings it back into a fresh engine's tables. A run is
``(run, last_seen, last_step, ended)``; an alert a JSON-ready row (:func:`export_row`,
NaN as None) carrying its rule's name and index, its series and the fields of its
state machine named in :data:`EXPORTED_FIELDS`. ``Engine.export_runs``,
``Engine.export_alerts`` and ``Engine.restore`` call these under the engine's lock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from trainvitals.alerts.alert_table import AlertTable
from trainvitals.alerts.instances import AlertInstance, RunState
from trainvitals.alerts.model import EventRule, Rule
from trainvitals.alerts.state import AlertState

__all__ = ["EXPORTED_FIELDS", "export_alerts", "export_row", "export_runs", "restore", "rule_index_of"]

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
"""The fields of an :class:`AlertInstance` a restart brings back as they were."""

RunRow = tuple[str, float, int, bool] | tuple[str, None, None, None]


def _number_or_nan(v: Any) -> float:
    return math.nan if v is None else float(v)


def export_row(key: tuple[Any, ...], inst: AlertInstance) -> dict[str, Any]:
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


def export_runs(runs: Mapping[str, RunState], names: Iterable[str]) -> list[RunRow]:
    """``(run, last_seen, last_step, ended)`` for each of ``names``; a run no longer
    in ``runs`` (forgotten) as ``(run, None, None, None)``."""
    out: list[RunRow] = []
    for name in names:
        info = runs.get(name)
        out.append((name, None, None, None) if info is None else (name, info.last_seen, info.last_step, info.ended))
    return out


def export_alerts(table: AlertTable) -> list[dict[str, Any]]:
    """Every pending, firing and recently resolved alert of ``table`` as a row."""
    return [export_row(key, inst) for key, inst in table.instances.items() if inst.state is not AlertState.INACTIVE]


def rule_index_of(by_name: Mapping[str, list[int]], row: Mapping[str, Any]) -> int | None:
    """The rule a persisted alert belongs to now: same name (and index, when rules were reordered)."""
    candidates = by_name.get(row["alertname"], [])
    if not candidates:
        return None
    index = row.get("rule_index")
    return index if index in candidates else candidates[0]


def restore(
    rules: list[Rule],
    by_name: Mapping[str, list[int]],
    runs: dict[str, RunState],
    table: AlertTable,
    run_rows: Iterable[tuple[str, float, int, bool]],
    alert_rows: Iterable[Mapping[str, Any]],
) -> list[Mapping[str, Any]]:
    """Put persisted runs into ``runs`` and alerts into ``table`` (what either holds
    already stays); return the alert rows whose rule is gone.

    A run comes back with its last report time, so RunSilent covers a run that went
    silent across the restart; an alert with its state, so a firing one resolves when
    its series clears and does not fire (page) again while it holds.
    """
    gone = []
    for run, last_seen, last_step, ended in run_rows:
        if run not in runs:
            runs[run] = RunState(last_seen, last_step, bool(ended))
    for row in alert_rows:
        index = rule_index_of(by_name, row)
        if index is None:
            gone.append(row)
            continue
        items = tuple((str(k), str(v)) for k, v in row["items"])
        key = (index, row["run"], int(row["rank"]), items)
        if key in table.instances:
            continue
        rule = rules[index]
        inst = table.new(key, rule, dict(row["labels"]), row["run"])
        for name in EXPORTED_FIELDS:
            if name in row:
                setattr(inst, name, row[name])
        inst.state = AlertState(row["state"])
        inst.value = _number_or_nan(row.get("value"))
        inst.fired_value = _number_or_nan(row.get("fired_value"))
        if isinstance(rule, EventRule):
            table.file_event(key, inst)
        if row["run"] not in runs:
            runs[row["run"]] = RunState(inst.since(), inst.step or 0)
    return gone
