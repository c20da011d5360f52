"""The collector's durable state: one SQLite file (setting ``state_path``).

What survives a restart (``docs/collector.md``, "Restarts"):

- runs: name, last report time (collector clock), last step, ended: so
  ``/v1/runs`` and ``trainvitals_step`` come back at once and RunSilent fires for
  a run that went silent across the restart;
- alerts: every pending, firing and recently resolved alert with its state, so a
  firing alert that clears resolves (once) and one still true does not page again;
- notifications: per notifier and alert, the last status delivered and what was
  sent, so a resolve lost to a crash is sent after the restart, and an alert whose
  rule was removed is resolved downstream.

Series values are not kept: they come back with each run's next report.
Writes: alert transitions at once (they are rare), runs in batches from the
alert ticker (about once a second). WAL journal, ``synchronous=NORMAL``: a
crash of the process loses nothing committed; a power cut may lose the last
second.
"""

from __future__ import annotations

import json
import math
import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["StateDB"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run TEXT PRIMARY KEY,
    last_seen REAL NOT NULL,
    last_step INTEGER NOT NULL,
    ended INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS alerts (
    id TEXT PRIMARY KEY,
    data TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS notified (
    notifier TEXT NOT NULL,
    id TEXT NOT NULL,
    status TEXT NOT NULL,
    at REAL NOT NULL,
    notification TEXT NOT NULL,
    PRIMARY KEY (notifier, id)
);
"""

_RESOLVED_KEEP = 7 * 86400.0  # seconds a delivered resolve is remembered


def alert_id(alertname: str, labels: Mapping[str, str]) -> str:
    """An alert's identity across restarts: its name and its series' labels."""
    return json.dumps([alertname, sorted(labels.items())], separators=(",", ":"))


class StateDB:
    """Runs, alert states and delivered notifications in one SQLite file; thread-safe."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise OSError(f"state_path {str(path)!r}: cannot open the SQLite state: {exc}") from None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _write(self, sql: str, rows: Iterable[tuple[Any, ...]]) -> None:
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.executemany(sql, rows)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

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
        with self._lock:
            self._db.execute("BEGIN")
            try:
                for run, seen, step, ended in runs:
                    if seen is None:
                        self._db.execute("DELETE FROM runs WHERE run = ?", (run,))
                    else:
                        self._db.execute(
                            "INSERT INTO runs VALUES (?, ?, ?, ?) ON CONFLICT(run) DO UPDATE SET "
                            "last_seen = excluded.last_seen, last_step = excluded.last_step, "
                            "ended = excluded.ended", (run, seen, step, int(bool(ended))))
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # -- alerts --------------------------------------------------------------

    def load_alerts(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT data FROM alerts").fetchall()
        return [json.loads(d) for (d,) in rows]

    def replace_alerts(self, alerts: Iterable[Mapping[str, Any]]) -> None:
        """Make the alerts table exactly ``alerts`` (engine export)."""
        rows = [(alert_id(a["alertname"], a["labels"]), json.dumps(a)) for a in alerts]
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.execute("DELETE FROM alerts")
                self._db.executemany("INSERT OR REPLACE INTO alerts VALUES (?, ?)", rows)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # -- notifications ---------------------------------------------------------

    def record_sent(self, notifier: str, notifications: Iterable[Any]) -> None:
        """Remember the last status delivered to ``notifier`` per alert (after a 2xx)."""
        now = time.time()
        rows = [(notifier, alert_id(n.alertname, _series(n.labels)), n.status, now,
                 json.dumps(_payload(n))) for n in notifications]
        self._write("INSERT INTO notified VALUES (?, ?, ?, ?, ?) ON CONFLICT(notifier, id) DO UPDATE "
                    "SET status = excluded.status, at = excluded.at, "
                    "notification = excluded.notification", rows)

    def load_notified(self) -> dict[tuple[str, str], tuple[str, dict[str, Any]]]:
        """(notifier, alert id) -> (last status delivered, what was sent)."""
        with self._lock:
            self._db.execute("DELETE FROM notified WHERE status = 'resolved' AND at < ?",
                             (time.time() - _RESOLVED_KEEP,))
            rows = self._db.execute("SELECT notifier, id, status, notification FROM notified").fetchall()
        return {(n, i): (s, json.loads(d)) for n, i, s, d in rows}


def _series(labels: Mapping[str, str]) -> dict[str, str]:
    """An alert's series labels: its notification labels without alertname and severity."""
    return {k: v for k, v in labels.items() if k not in ("alertname", "severity")}


def _payload(n: Any) -> dict[str, Any]:
    return {"labels": dict(n.labels), "annotations": dict(n.annotations), "starts_at": n.starts_at,
            "value": n.value if math.isfinite(n.value) else None, "generator_url": n.generator_url}
