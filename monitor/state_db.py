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
  so a restart neither drops nor extends them;
- each run's first drift references (:mod:`trainvitals.monitor.lifetime`), kept
  while the run reports within 30 days, so ParamDrift judges a resumed run's
  whole life (they outlive the run's expiry: a job resumed hours later goes on).

Series values are not kept: they come back with each run's next report.
Writes: alert transitions and the ``seq`` numbers of each accepted body at once
(before the answer goes out), runs in batches from the alert ticker (about once
a second). WAL journal, ``synchronous=NORMAL``: a crash of the process loses
nothing committed; a power cut may lose the last second.

One collector per file, whatever path leads to it: the file itself is locked
(``flock`` on its inode, so a symbolic or hard link to it is refused too) and its
resolved path is claimed (an abstract socket named after it, Linux), so a second
collector started after the first one's folder was deleted is refused as well.

The disk may fail under a running collector. A failed write is logged (each kind of
write with its own line and repeat budget), counted
(``trainvitals_collector_state_write_errors_total{write}``) and makes
:attr:`StateDB.problem` say why (``/readyz`` answers degraded); nothing is lost from
memory: the ``seq`` numbers not written are kept and written with the next success,
and :meth:`StateDB.check_file` (every few seconds) notices the file deleted or replaced
and writes everything held back to its path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import sqlite3
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

from trainvitals.alerts.persistence import alert_id
from trainvitals.wire import METRICS, PREFIX, ends_run
from trainvitals.wire.errors import StateError

try:
    import fcntl
except ImportError:  # Windows: no advisory lock, the file is still usable
    fcntl = None  # type: ignore[assignment]

__all__ = ["SEQ_WINDOW", "WRITES", "StateDB", "StateInUse", "StateUnusable", "StateWriteError", "alert_id"]

log = logging.getLogger("trainvitals.monitor.state")

SEQ_WINDOW = 4096  # seq numbers kept per (run, rank, sender); older ones count as applied
_MAX_UNSAVED_SEQS = 1_000_000  # seq rows held in memory while the disk refuses them

# Values of trainvitals_collector_state_write_errors_total{write}.
WRITES = ("seqs", "runs", "alerts", "notified", "run_settings", "drift_refs", "recreate")
# One message per kind of write: the log's repeat filter keys on the message, so a
# flood of one kind never hides another.
_WRITE_FAILED = {
    "seqs": "state file %s: cannot record the reports applied (%s); retried ingests are answered 503 until it can",
    "runs": "state file %s: cannot save the runs (%s); kept in memory, saved again once it can",
    "alerts": "state file %s: cannot save the alert states (%s); kept in memory, saved again once it can",
    "notified": "state file %s: cannot record the notifications delivered (%s); kept in memory, saved again",
    "run_settings": "state file %s: cannot save live settings (%s)",
    "drift_refs": "state file %s: cannot save the runs' first drift references (%s); kept in memory",
    "recreate": "state file %s: cannot write it back (%s); retried every few seconds",
}

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
CREATE TABLE IF NOT EXISTS drift_refs (
    run TEXT NOT NULL,
    rank INTEGER NOT NULL,
    param TEXT NOT NULL,
    ref REAL NOT NULL,
    scale REAL NOT NULL,
    PRIMARY KEY (run, rank, param)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS drift_runs (
    run TEXT PRIMARY KEY,
    seen REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS run_settings (
    run TEXT PRIMARY KEY,
    data TEXT NOT NULL,
    set_at REAL NOT NULL,
    expires_at REAL NOT NULL
);
"""

_RESOLVED_KEEP = 7 * 86400.0  # seconds a delivered resolve is remembered


class StateInUse(StateError):
    """Another running collector holds the state file."""


class StateUnusable(StateError):
    """The state file cannot be used as it is (damaged, foreign, read-only); nothing was
    written to it. The message is one line: what is wrong, the path, how to move it aside."""


class StateWriteError(StateError):
    """A write to the state file failed (disk full, file gone read-only...); logged and
    counted by the :class:`StateDB` that raised it."""


# The columns each table must have: a file with other columns was written by something else.
_COLUMNS = {
    "runs": ("run", "last_seen", "last_step", "ended"),
    "alerts": ("id", "data"),
    "notified": ("notifier", "id", "status", "at", "notification"),
    "seqs": ("run", "rank", "sender", "seq"),
    "seq_floors": ("run", "rank", "sender", "floor"),
    "run_settings": ("run", "data", "set_at", "expires_at"),
    "drift_refs": ("run", "rank", "param", "ref", "scale"),
    "drift_runs": ("run", "seen"),
}
# (table, JSON column) read back at start: a row that is not JSON is a damaged file.
_JSON_COLUMNS = (("alerts", "data"), ("notified", "notification"), ("run_settings", "data"))


class StateDB:
    """Runs, alert states, delivered notifications and applied reports in one SQLite file;
    thread-safe. Opening raises :class:`OSError`: :class:`StateInUse` when another
    collector holds the file, :class:`StateUnusable` when it is damaged, foreign or
    read-only, each a message naming the path. Writes raise :class:`StateWriteError`
    (logged and counted here), except :meth:`record_seqs`, which keeps what it could not
    write (:meth:`seqs_saved`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._memory = str(path) == ":memory:"
        self._lock = threading.RLock()
        self._fd: int | None = None  # the file itself, held open and flocked
        self._claim: socket.socket | None = None  # the resolved path's name, claimed
        # Sequence numbers recorded per (run, rank, sender) since its last prune.
        self._since_prune: dict[tuple[str, int, str], int] = {}
        self._unsaved_seqs: list[tuple[str, int, str, int]] = []
        self._unsaved_runs: dict[str, tuple[str, float, int, int]] = {}
        self.write_errors = dict.fromkeys(WRITES, 0)
        self._failing: dict[str, str] = {}  # kind of write -> why it failed last
        self._lost: str | None = None  # the file is gone or replaced and not yet written back
        self.on_recreated: list[Callable[[], None]] = []
        if self._memory:
            self._db = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
            self._db.executescript(_SCHEMA)
            return
        shown = str(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(
                f"state_path {shown!r}: cannot create its folder: {exc.strerror}; "
                "set state_path to a writable file, or 'memory'"
            ) from None
        self._claim = _claim_name(self.path)
        try:
            self._fd = _open_locked(self.path)
            self._db = _connect(self.path)
        except BaseException:
            self._release()
            raise

    @property
    def problem(self) -> str | None:
        """Why the state is not being written now (None: it is); ``/readyz`` shows it."""
        with self._lock:
            if self._lost is not None:
                return self._lost
            if self._failing:
                kind, why = next(iter(self._failing.items()))
                return f"state file {str(self.path)!r}: {kind} not written: {why}"
            return None

    def close(self) -> None:
        with self._lock:
            self._db.close()
        self._release()

    def _release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file releases the flock
            self._fd = None
        if self._claim is not None:
            self._claim.close()
            self._claim = None

    def _failed(self, kind: str, exc: BaseException) -> StateWriteError:
        why = str(exc) or type(exc).__name__
        with self._lock:
            self.write_errors[kind] += 1
            self._failing[kind] = why
        log.warning(_WRITE_FAILED[kind], str(self.path), why)
        return StateWriteError(f"state file {str(self.path)!r}: {kind} not written: {why}")

    def _ok(self, kind: str) -> None:
        """A write succeeded: the disk takes writes again (every kind's failure is over)."""
        if self._failing:
            with self._lock:
                was, self._failing = self._failing, {}
            if was:
                log.warning("state file %s: written again (%s)", str(self.path), kind)

    def _tx(self, kind: str, body: Callable[[], object]) -> None:
        """Run ``body`` in one transaction; a failure rolls back, is counted and raised."""
        with self._lock:
            try:
                self._db.execute("BEGIN")
                try:
                    body()
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
            except (sqlite3.Error, OSError) as exc:
                if self._db.in_transaction:
                    try:
                        self._db.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass
                raise self._failed(kind, exc) from None
        self._ok(kind)

    def _write(self, sql: str, rows: Iterable[tuple[Any, ...]], kind: str) -> None:
        rows = list(rows)
        self._tx(kind, lambda: self._db.executemany(sql, rows))

    def metric_families(self) -> Iterator[Metric]:
        """``trainvitals_collector_state_write_errors_total{write}`` (a family source)."""
        family = CounterMetricFamily(
            PREFIX + "collector_state_write_errors",
            METRICS["collector_state_write_errors_total"].help,
            labels=["write"],
        )
        with self._lock:
            counts = dict(self.write_errors)
        for kind in WRITES:
            family.add_metric([kind], counts[kind])
        yield family

    # -- the file itself ---------------------------------------------------------

    def check_file(self) -> bool:
        """Notice the file deleted or replaced under us: warn, write everything held back
        to the path (a replacing file is moved aside first) and go on there. True when the
        path holds our file (again); called every few seconds by the collector."""
        if self._memory or self._fd is None:
            return True
        with self._lock:
            held = os.fstat(self._fd)
            try:
                now = os.stat(self.path)
            except FileNotFoundError:
                now = None
            except OSError:
                return self._lost is None
            if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                return True
            what = "deleted" if now is None else "replaced by another file"
            if self._lost is None:
                log.warning(
                    "state file %s was %s while the collector runs; writing what it holds back to that path",
                    str(self.path),
                    what,
                )
            self._lost = f"state file {str(self.path)!r} was {what}; not written back yet"
            try:
                self._recreate(moved_aside=now is not None)
            except (sqlite3.Error, OSError) as exc:
                self._failed("recreate", exc)
                return False
            self._lost = None
            self._failing.pop("recreate", None)
        log.warning("state file %s written back: runs, alerts, notifications and reports applied", str(self.path))
        for callback in list(self.on_recreated):
            try:
                callback()
            except Exception:
                log.exception("state file %s: a callback after writing it back failed", str(self.path))
        return True

    def _recreate(self, *, moved_aside: bool) -> None:
        path = self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".rewrite")
        for leftover in (tmp, Path(str(tmp) + "-journal")):
            leftover.unlink(missing_ok=True)
        copy = sqlite3.connect(str(tmp))
        try:
            self._db.backup(copy)  # our connection still reads the unlinked file
        finally:
            copy.close()
        fd = _open_locked(tmp)
        if moved_aside:
            aside = path.with_name(f"{path.name}.replaced-{int(time.time())}")
            try:
                os.replace(path, aside)
                log.warning("state file %s: the file found there was moved to %s", str(path), str(aside))
            except FileNotFoundError:
                pass
        os.replace(tmp, path)
        old_db, old_fd = self._db, self._fd
        self._db, self._fd = _connect(path), fd
        try:
            old_db.close()
        except sqlite3.Error:
            pass
        if old_fd is not None:
            os.close(old_fd)

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

    # -- reports applied (sender/seq) --------------------------------------------

    def record_seqs(self, batch: Any, now: float | None = None) -> None:
        """Remember the ``seq`` of every report in ``batch`` that has one, and its run (the
        store's ``on_ingest`` signature: called with the reports applied, before the answer).

        The run is written too, so that a crash before the next batched save of the runs
        still brings the run, and so its duplicate memory, back. Never raises: what the
        disk refuses is kept and written with the next success; :meth:`seqs_saved` says
        whether everything is written (the ingest answers 503 until it is)."""
        now = time.time() if now is None else now
        rows = [(r.run, r.rank, r.sender, r.seq) for r in batch.reports if r.seq is not None]
        if not rows:
            return
        runs = {r.run: (r.run, now, r.step, int(ends_run(r))) for r in batch.reports}
        with self._lock:
            if len(self._unsaved_seqs) < _MAX_UNSAVED_SEQS:
                self._unsaved_seqs.extend(rows)
            self._unsaved_runs.update(runs)
            self._flush_seqs_locked()

    def retry_writes(self) -> bool:
        """Try again what the disk refused (the collector calls it every few seconds):
        the ``seq`` numbers held, else one small write, so that :attr:`problem` clears
        once the disk takes writes again even when nothing else is written. True when
        nothing is failing."""
        if self._unsaved_seqs or self._unsaved_runs:
            return self.seqs_saved()
        if not self._failing:
            return True
        kind = next(iter(self._failing))
        try:
            stamp = int(time.time() * 1000) % 2**31  # a value that changes: a real write
            self._tx(kind, lambda: self._db.execute(f"PRAGMA user_version = {stamp}"))
        except StateWriteError:
            return False
        return True

    def seqs_saved(self) -> bool:
        """True when every ``seq`` recorded is in the file (tries again what was not)."""
        if not self._unsaved_seqs:
            return True
        with self._lock:
            return self._flush_seqs_locked()

    def _flush_seqs_locked(self) -> bool:
        rows, runs = self._unsaved_seqs, list(self._unsaved_runs.values())
        if not rows and not runs:
            return True
        prune = []
        counts = dict(self._since_prune)
        for run, rank, sender, _ in rows:
            key = (run, rank, sender)
            n = counts[key] = counts.get(key, 0) + 1
            if n >= SEQ_WINDOW:
                prune.append(key)
                counts[key] = 0

        def body() -> None:
            self._db.executemany("INSERT OR IGNORE INTO seqs VALUES (?, ?, ?, ?)", rows)
            self._db.executemany(
                "INSERT INTO runs VALUES (?, ?, ?, ?) ON CONFLICT(run) DO UPDATE SET "
                "last_seen = max(last_seen, excluded.last_seen), last_step = excluded.last_step, "
                "ended = excluded.ended",
                runs,
            )
            for run, rank, sender in prune:
                self._prune_locked(run, rank, sender)

        try:
            self._tx("seqs", body)
        except StateWriteError:
            return False
        self._since_prune = counts
        self._unsaved_seqs = []
        self._unsaved_runs = {}
        return True

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

    def load_drift_refs(self, since: float) -> list[tuple[str, int, str, float, float]]:
        """``(run, rank, param, ref, scale)`` of the runs seen since ``since`` (older ones are
        deleted)."""
        try:
            self._tx(
                "drift_refs",
                lambda: (
                    self._db.execute(
                        "DELETE FROM drift_refs WHERE run IN (SELECT run FROM drift_runs WHERE seen < ?)", (since,)
                    ),
                    self._db.execute("DELETE FROM drift_runs WHERE seen < ?", (since,)),
                ),
            )
        except StateWriteError:
            pass  # counted and logged; what is there is still read
        with self._lock:
            rows = self._db.execute("SELECT run, rank, param, ref, scale FROM drift_refs").fetchall()
        return [(r, int(k), p, float(v), float(sc)) for r, k, p, v, sc in rows]

    def save_drift_refs(
        self, refs: Iterable[tuple[str, int, str, float, float, float]], runs: Iterable[str], now: float
    ) -> None:
        """Keep first references ``(run, rank, param, ref, scale, now)`` (a kept one is not
        replaced) and mark ``runs`` seen at ``now``."""
        refs, runs = list(refs), sorted(set(runs) | {r[0] for r in refs})

        def body() -> None:
            self._db.executemany(
                "INSERT OR IGNORE INTO drift_refs VALUES (?, ?, ?, ?, ?)",
                [(r, k, p, v, sc) for r, k, p, v, sc, _ in refs],
            )
            self._db.executemany(
                "INSERT INTO drift_runs VALUES (?, ?) ON CONFLICT(run) DO UPDATE SET seen = excluded.seen",
                [(run, now) for run in runs],
            )

        try:
            self._tx("drift_refs", body)
        except StateWriteError:
            pass  # counted and logged by _tx; the references stay in memory

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
            "run_settings",
        )

    def delete_run_settings(self, run: str) -> None:
        self._write("DELETE FROM run_settings WHERE run = ?", [(run,)], "run_settings")


def _move_aside(path: Path, why: str, fix: str = "") -> StateUnusable:
    shown = str(path)
    return StateUnusable(
        f"state_path {shown!r} {why}; nothing was written to it: {fix}move it aside "
        f"(mv {shown!r} {shown + '.bad'!r}) to start with an empty state, or set state_path to another file"
    )


def _claim_name(path: Path) -> socket.socket | None:
    """Claim the resolved path (an abstract Unix socket named after its hash, Linux), so a
    second collector is refused even where the first one's file was deleted with its folder
    (a lock on the file cannot see that). None where there are no abstract sockets."""
    if not sys.platform.startswith("linux"):
        return None
    resolved = os.path.realpath(path)
    name = b"\0trainvitals-state-" + hashlib.sha256(resolved.encode()).hexdigest()[:40].encode()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(name)
        sock.listen(8)
    except OSError:
        sock.close()
        raise StateInUse(
            f"state_path {str(path)!r} is in use by another running collector{_holder_of_name(name)} "
            f"(it resolves to {resolved!r}): give each collector its own state_path, or state_path: memory"
        ) from None
    return sock


def _holder_of_name(name: bytes) -> str:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            probe.connect(name)
            creds = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid = struct.unpack("3i", creds)[0]
        return f" (pid {pid})" if pid > 0 else ""
    except OSError:
        return ""


def _holder_of_lock(st: os.stat_result) -> str:
    """The pid holding an flock on this inode, from /proc/locks (Linux), as ' (pid N)'."""
    wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii") as fh:
            for line in fh:
                parts = line.split()
                if "FLOCK" in parts and len(parts) >= 6 and parts[5] == wanted:
                    return f" (pid {parts[4]})"
    except OSError:
        pass
    return ""


def _open_locked(path: Path) -> int:
    """Open the file itself (created when missing) and hold an exclusive ``flock`` on it:
    a link to it, of any kind, leads to the same lock. StateInUse when another holds it,
    StateUnusable when it is read-only or not a file."""
    shown = str(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise OSError(f"state_path {shown!r}: cannot read it: {exc.strerror}") from None
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            raise _move_aside(path, "is not a regular file")
        # Root may write a 0444 file, but a file made read-only says to leave it alone.
        if not st.st_mode & 0o222 or not os.access(path, os.W_OK):
            raise _move_aside(path, "is read-only", f"make it writable (chmod u+w {shown!r}), or ")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as exc:
        if st is not None:
            raise _move_aside(path, f"cannot be opened for writing ({exc.strerror})") from None
        raise OSError(
            f"state_path {shown!r}: cannot create it: {exc.strerror}; set state_path to a writable file, or 'memory'"
        ) from None
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _holder_of_lock(os.fstat(fd))
            os.close(fd)
            raise StateInUse(
                f"state_path {shown!r} is in use by another running collector{holder} (the same file, "
                "perhaps through a link): give each collector its own state_path, or state_path: memory"
            ) from None
    return fd


def _connect(path: Path) -> sqlite3.Connection:
    """Open, check and (when new) create the SQLite state; StateUnusable with one line
    when the file is damaged, written by something else, or refuses writes."""
    shown = str(path)
    db = sqlite3.connect(shown, check_same_thread=False, isolation_level=None)
    try:
        try:
            check = db.execute("PRAGMA quick_check").fetchone()
        except sqlite3.DatabaseError as exc:
            raise _move_aside(path, f"is not a usable SQLite file ({exc})") from None
        if check is None or check[0] != "ok":
            raise _move_aside(path, f"is damaged (SQLite integrity check: {check[0] if check else 'no answer'})")
        tables = {
            name: tuple(row[1] for row in db.execute(f"PRAGMA table_info({name})"))
            for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
        for name, columns in _COLUMNS.items():
            if name in tables and tables[name] != columns:
                raise _move_aside(
                    path,
                    f"was written by something else: its table {name!r} has the columns "
                    f"({', '.join(tables[name])}), a trainvitals state has ({', '.join(columns)})",
                )
        for table, column in _JSON_COLUMNS:
            if table not in tables:
                continue
            for (text,) in db.execute(f"SELECT {column} FROM {table}"):
                try:
                    json.loads(text)
                except (TypeError, ValueError):
                    raise _move_aside(path, f"is damaged: a row of its table {table!r} is not JSON") from None
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
            db.execute("BEGIN IMMEDIATE")  # a file that takes no write lock is one we cannot use
            db.execute("ROLLBACK")
        except sqlite3.Error as exc:
            raise _move_aside(path, f"cannot be written ({exc})") from None
    except BaseException:
        db.close()
        raise
    return db


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
