"""The collector's durable state: one SQLite file (setting ``state_path``).

What survives a restart (``docs/collector.md``, "Restarts"):

- runs: name, last report time (collector clock), last step, ended: so
  ``/v1/runs`` and ``trainvitals_step`` come back at once and RunSilent fires for
  a run that went silent across the restart;
- alerts: every pending, firing and recently resolved alert with its state, so a
  firing alert that clears resolves (once) and one still true does not page again;
- notifications: per notifier and alert, the last status delivered and what was
  sent, so a resolve lost to a crash is sent after the restart, and an alert whose
  rule was removed is resolved downstream;
- reports applied: per run, rank and sender, the ``seq`` numbers applied (the
  newest :data:`SEQ_WINDOW`; older ones count as applied), so a retry that
  straddles a restart is recognised as a duplicate;
- live settings (``trainvitals configure``): per run, what was set and until when,
  so a restart neither drops nor extends them.

Series values are not kept: they come back with each run's next report.
Writes: alert transitions and the ``seq`` numbers of each accepted body at once
(before the answer goes out), runs in batches from the alert ticker (about once
a second). WAL journal, ``synchronous=NORMAL``: a crash of the process loses
nothing committed; a power cut may lose the last second.

One collector per file: the file is locked (``<path>.lock``, ``flock``) while
open, so a second collector pointed at the same file refuses to start instead
of overwriting the first one's alerts.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

from trainvitals.wire import ends_run

try:
    import fcntl
except ImportError:  # Windows: no advisory lock, the file is still usable
    fcntl = None  # type: ignore[assignment]

__all__ = ["SEQ_WINDOW", "StateDB", "StateInUse"]

SEQ_WINDOW = 4096  # seq numbers kept per (run, rank, sender); older ones count as applied

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
CREATE TABLE IF NOT EXISTS seqs (
    run TEXT NOT NULL,
    rank INTEGER NOT NULL,
    sender TEXT NOT NULL,
    seq INTEGER NOT NULL,
    PRIMARY KEY (run, rank, sender, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS seq_floors (
    run TEXT NOT NULL,
    rank INTEGER NOT NULL,
    sender TEXT NOT NULL,
    floor INTEGER NOT NULL,
    PRIMARY KEY (run, rank, sender)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS run_settings (
    run TEXT PRIMARY KEY,
    data TEXT NOT NULL,
    set_at REAL NOT NULL,
    expires_at REAL NOT NULL
);
"""

_RESOLVED_KEEP = 7 * 86400.0  # seconds a delivered resolve is remembered


def alert_id(alertname: str, labels: Mapping[str, str]) -> str:
    """An alert's identity across restarts: its name and its series' labels."""
    return json.dumps([alertname, sorted(labels.items())], separators=(",", ":"))


class StateInUse(OSError):
    """Another running collector holds the state file."""


class StateDB:
    """Runs, alert states, delivered notifications and applied reports in one SQLite file;
    thread-safe. Raises :class:`OSError` (:class:`StateInUse` when another collector
    holds the file) with a message naming the path."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lockfile: IO[str] | None = None
        self._lock = threading.Lock()
        # Sequence numbers recorded per (run, rank, sender) since its last prune.
        self._since_prune: dict[tuple[str, int, str], int] = {}
        if str(path) != ":memory:":
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise OSError(
                    f"state_path {str(path)!r}: cannot create its folder: {exc.strerror}; "
                    "set state_path to a writable file, or 'memory'"
                ) from None
            self._lockfile = _lock(self.path)
        try:
            self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            self._unlock()
            raise OSError(f"state_path {str(path)!r}: cannot open the SQLite state: {exc}") from None

    def close(self) -> None:
        with self._lock:
            self._db.close()
        self._unlock()

    def _unlock(self) -> None:
        if self._lockfile is not None:
            self._lockfile.close()  # closing the file releases the flock
            self._lockfile = None

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
                        self._db.execute("DELETE FROM seqs WHERE run = ?", (run,))
                        self._db.execute("DELETE FROM seq_floors WHERE run = ?", (run,))
                    else:
                        self._db.execute(
                            "INSERT INTO runs VALUES (?, ?, ?, ?) ON CONFLICT(run) DO UPDATE SET "
                            "last_seen = excluded.last_seen, last_step = excluded.last_step, "
                            "ended = excluded.ended",
                            (run, seen, step, int(bool(ended))),
                        )
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
        rows = [
            (notifier, alert_id(n.alertname, _series(n.labels)), n.status, now, json.dumps(_payload(n)))
            for n in notifications
        ]
        self._write(
            "INSERT INTO notified VALUES (?, ?, ?, ?, ?) ON CONFLICT(notifier, id) DO UPDATE "
            "SET status = excluded.status, at = excluded.at, "
            "notification = excluded.notification",
            rows,
        )

    def load_notified(self) -> dict[tuple[str, str], tuple[str, dict[str, Any]]]:
        """(notifier, alert id) -> (last status delivered, what was sent)."""
        with self._lock:
            self._db.execute(
                "DELETE FROM notified WHERE status = 'resolved' AND at < ?", (time.time() - _RESOLVED_KEEP,)
            )
            rows = self._db.execute("SELECT notifier, id, status, notification FROM notified").fetchall()
        return {(n, i): (s, json.loads(d)) for n, i, s, d in rows}

    # -- reports applied (sender/seq) --------------------------------------------

    def record_seqs(self, batch: Any, now: float | None = None) -> None:
        """Remember the ``seq`` of every report in ``batch`` that has one, and its run (the
        store's ``on_ingest`` signature: called with the reports applied, before the answer).

        The run is written too, so that a crash before the next batched save of the runs
        still brings the run, and so its duplicate memory, back."""
        now = time.time() if now is None else now
        rows = [(r.run, r.rank, r.sender, r.seq) for r in batch.reports if r.seq is not None]
        if not rows:
            return
        runs = {r.run: (r.run, now, r.step, int(ends_run(r))) for r in batch.reports}
        prune = []
        with self._lock:
            for run, rank, sender, _ in rows:
                key = (run, rank, sender)
                n = self._since_prune[key] = self._since_prune.get(key, 0) + 1
                if n >= SEQ_WINDOW:
                    prune.append(key)
                    self._since_prune[key] = 0
            self._db.execute("BEGIN")
            try:
                self._db.executemany("INSERT OR IGNORE INTO seqs VALUES (?, ?, ?, ?)", rows)
                self._db.executemany(
                    "INSERT INTO runs VALUES (?, ?, ?, ?) ON CONFLICT(run) DO UPDATE SET "
                    "last_seen = max(last_seen, excluded.last_seen), last_step = excluded.last_step, "
                    "ended = excluded.ended",
                    list(runs.values()),
                )
                for run, rank, sender in prune:
                    self._prune_locked(run, rank, sender)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _prune_locked(self, run: str, rank: int, sender: str) -> None:
        """Keep the newest SEQ_WINDOW numbers of one sender; the rest become its floor."""
        row = self._db.execute(
            "SELECT seq FROM seqs WHERE run = ? AND rank = ? AND sender = ? ORDER BY seq DESC LIMIT 1 OFFSET ?",
            (run, rank, sender, SEQ_WINDOW),
        ).fetchone()
        if row is None:
            return
        floor = int(row[0])
        self._db.execute(
            "DELETE FROM seqs WHERE run = ? AND rank = ? AND sender = ? AND seq <= ?", (run, rank, sender, floor)
        )
        self._db.execute(
            "INSERT INTO seq_floors VALUES (?, ?, ?, ?) ON CONFLICT(run, rank, sender) "
            "DO UPDATE SET floor = max(floor, excluded.floor)",
            (run, rank, sender, floor),
        )

    def load_seqs(self) -> list[tuple[str, int, str, int, list[int]]]:
        """``(run, rank, sender, floor, seqs)``: every seq at or below ``floor`` counts as
        applied (-1: none), and so does each one in ``seqs``."""
        out: dict[tuple[str, int, str], tuple[int, list[int]]] = {}
        with self._lock:
            for run, rank, sender, floor in self._db.execute("SELECT * FROM seq_floors"):
                out[(run, rank, sender)] = (int(floor), [])
            for run, rank, sender, seq in self._db.execute(
                "SELECT run, rank, sender, seq FROM seqs ORDER BY run, rank, sender, seq"
            ):
                out.setdefault((run, rank, sender), (-1, []))[1].append(int(seq))
        return [(run, rank, sender, floor, seqs) for (run, rank, sender), (floor, seqs) in out.items()]

    # -- live settings -----------------------------------------------------------

    def load_run_settings(self) -> list[tuple[str, dict[str, Any], float, float]]:
        """``(run, settings, set_at, expires_at)`` for every run's live settings kept."""
        with self._lock:
            rows = self._db.execute("SELECT run, data, set_at, expires_at FROM run_settings").fetchall()
        return [(r, json.loads(d), float(s), float(e)) for r, d, s, e in rows]

    def save_run_settings(self, run: str, settings: Mapping[str, Any], set_at: float, expires_at: float) -> None:
        self._write(
            "INSERT INTO run_settings VALUES (?, ?, ?, ?) ON CONFLICT(run) DO UPDATE SET "
            "data = excluded.data, set_at = excluded.set_at, expires_at = excluded.expires_at",
            [(run, json.dumps(dict(settings)), set_at, expires_at)],
        )

    def delete_run_settings(self, run: str) -> None:
        self._write("DELETE FROM run_settings WHERE run = ?", [(run,)])


def _lock(path: Path) -> IO[str] | None:
    """Hold ``<path>.lock`` exclusively (with our pid in it); StateInUse when another has it."""
    if fcntl is None:
        return None
    lock_path = path.with_name(path.name + ".lock")
    try:
        fh = open(lock_path, "a+", encoding="utf-8")  # held open until close()
    except OSError as exc:
        raise OSError(
            f"state_path {str(path)!r}: cannot create {str(lock_path)!r}: {exc.strerror}; "
            "set state_path to a writable file, or 'memory'"
        ) from None
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.seek(0)
        holder = fh.read().strip() or "?"
        fh.close()
        raise StateInUse(
            f"state_path {str(path)!r} is in use by another running collector (pid "
            f"{holder}): give each collector its own state_path, or state_path: "
            "memory"
        ) from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"{os.getpid()}\n")
    fh.flush()
    return fh


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
