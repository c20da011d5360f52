"""What the alert service asks of a store that keeps its state across restarts.

The alerts package defines the interface; the collector implements it (its
state file, ``monitor/state_db.py``), so alerts never imports the collector.
An alert's identity across restarts is :func:`alert_id`, used by both.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from trainvitals.alerts.notifiers.base import Notification

__all__ = ["AlertPersistence", "alert_id"]


def alert_id(alertname: str, labels: Mapping[str, str]) -> str:
    """An alert's identity across restarts: its name and its series' labels."""
    return json.dumps([alertname, sorted(labels.items())], separators=(",", ":"))


class AlertPersistence(Protocol):
    """Runs, alert states and the notifications delivered, kept across restarts."""

    def load_runs(self) -> list[tuple[str, float, int, bool]]:
        """Every run as (run, last seen, last step, ended)."""
        ...

    def save_runs(self, runs: Iterable[tuple[str, float | None, int | None, bool | None]]) -> None:
        """Upsert runs; a None field keeps the stored value (a run that expired: all None, deleted)."""
        ...

    def load_alerts(self) -> list[dict[str, Any]]:
        """The alert rows :meth:`replace_alerts` last wrote."""
        ...

    def replace_alerts(self, alerts: Iterable[Mapping[str, Any]]) -> None:
        """Replace every stored alert with these rows (``Engine.export_alerts()``)."""
        ...

    def record_sent(self, notifier: str, notifications: Iterable[Notification]) -> None:
        """Notifications a notifier delivered (the last status per alert counts)."""
        ...

    def load_notified(self) -> dict[tuple[str, str], tuple[str, dict[str, Any]]]:
        """(notifier, alert id) -> (last status delivered, what was sent)."""
        ...
