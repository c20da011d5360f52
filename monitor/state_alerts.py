"""The alert service's state in the state file: runs, alert states, and the
notifications delivered. This implements :class:`trainvitals.alerts.persistence.AlertPersistence`.

- runs: name, last report time (collector clock), last step, ended: so
  ``/v1/runs`` and ``trainvitals_step`` come back at once and RunSilent fires for
  a run that went silent across the restart (a run that expired takes its reports
  applied and live settings with it);
- alerts: every pending, firing and recently resolved alert with its state, so a
  firing alert that clears resolves (once) and one still true does not page again;
- notifications: per notifier and alert, the last status delivered and what was
  sent, so a resolve lost to a crash is sent after the restart, and an alert whose
  rule was removed is resolved downstream.
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from collections.abc import Iterable, Mapping
from typing import Any

from trainvitals.alerts.persistence import alert_id
from trainvitals.monitor.state_writes import StateWrites

__all__ = ["AlertTables"]

_RESOLVED_KEEP = 7 * 86400.0  # seconds a delivered resolve is remembered


class AlertTables(StateWrites):
    """Runs, alerts and notifications delivered (the alert service's persistence)."""

    # -- runs ----------------------------------------------------------------

    def load_runs(self) -> list[tuple[str, float, int, bool]]:
        """``(run, last_seen, last_step, ended)`` for every run kept."""
        with self._lock:
            rows = self._db.execute("SELECT run, last_seen, last_step, ended FROM runs").fetchall()
        return [(r, float(t), int(s), bool(e)) for r, t, s, e in rows]

    def save_runs(self, runs: Iterable[tuple[str, float | None, int | None, bool | None]]) -> None:
        """Upsert runs; a run given as ``(run, None, None, None)`` is deleted (it expired)."""
        runs = list(runs)
        if not runs:
            return

        def body() -> None:
            for run, seen, step, ended in runs:
                if seen is None:
                    self._db.execute("DELETE FROM runs WHERE run = ?", (run,))
                    self._db.execute("DELETE FROM seqs WHERE run = ?", (run,))
                    self._db.execute("DELETE FROM seq_floors WHERE run = ?", (run,))
                    self._db.execute("DELETE FROM run_settings WHERE run = ?", (run,))
                else:
                    self._db.execute(
                        "INSERT INTO runs VALUES (?, ?, ?, ?) ON CONFLICT(run) DO UPDATE SET "
                        "last_seen = excluded.last_seen, last_step = excluded.last_step, "
                        "ended = excluded.ended",
                        (run, seen, step, int(bool(ended))),
                    )

        self._tx("runs", body)

    # -- alerts --------------------------------------------------------------

    def load_alerts(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT data FROM alerts").fetchall()
        return [json.loads(d) for (d,) in rows]

    def replace_alerts(self, alerts: Iterable[Mapping[str, Any]]) -> None:
        """Make the alerts table exactly ``alerts`` (engine export)."""
        rows = [(alert_id(a["alertname"], a["labels"]), json.dumps(a)) for a in alerts]

        def body() -> None:
            self._db.execute("DELETE FROM alerts")
            self._db.executemany("INSERT OR REPLACE INTO alerts VALUES (?, ?)", rows)

        self._tx("alerts", body)

    # -- notifications ---------------------------------------------------------

    def record_sent(self, notifier: str, notifications: Iterable[Any]) -> None:
        """Remember the last status delivered to ``notifier`` per alert (after a 2xx)."""
        now = time.time()
        rows = [
            (notifier, alert_id(n.alertname, _series(n.labels)), n.status, now, json.dumps(_payload(n)))
            for n in notifications
        ]
        self._write(
            "INSERT INTO notified VALUES (?, ?, ?, ?, ?) ON CONFLICT(notifier, id) DO UPDATE "
            "SET status = excluded.status, at = excluded.at, "
            "notification = excluded.notification",
            rows,
            "notified",
        )

    def load_notified(self) -> dict[tuple[str, str], tuple[str, dict[str, Any]]]:
        """(notifier, alert id) -> (last status delivered, what was sent)."""
        with self._lock:
            try:
                self._db.execute(
                    "DELETE FROM notified WHERE status = 'resolved' AND at < ?", (time.time() - _RESOLVED_KEEP,)
                )
            except sqlite3.Error as exc:
                self._failed("notified", exc)
            rows = self._db.execute("SELECT notifier, id, status, notification FROM notified").fetchall()
        return {(n, i): (s, json.loads(d)) for n, i, s, d in rows}


def _series(labels: Mapping[str, str]) -> dict[str, str]:
    """An alert's series labels: its notification labels without alertname and severity."""
    return {k: v for k, v in labels.items() if k not in ("alertname", "severity")}


def _payload(n: Any) -> dict[str, Any]:
    return {
        "labels": dict(n.labels),
        "annotations": dict(n.annotations),
        "starts_at": n.starts_at,
        "value": n.value if math.isfinite(n.value) else None,
        "generator_url": n.generator_url,
    }
