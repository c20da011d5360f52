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

The parts: :mod:`~trainvitals.monitor.state_file` (the schema, opening and locking the
file), :mod:`~trainvitals.monitor.state_writes` (transactions, failed writes),
:mod:`~trainvitals.monitor.state_alerts` (runs, alerts, notifications: the alert
service's persistence), :mod:`~trainvitals.monitor.state_seqs` (reports applied),
:mod:`~trainvitals.monitor.state_run_data` (drift references, live settings);
:class:`StateDB` puts them together and watches the file.
"""

from __future__ import annotations

import logging
import os
import socket
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

from trainvitals.alerts.persistence import alert_id
from trainvitals.monitor.dedup import SEQ_WINDOW
from trainvitals.monitor.state_alerts import AlertTables
from trainvitals.monitor.state_file import SCHEMA, StateInUse, StateUnusable, claim_name, connect, open_locked
from trainvitals.monitor.state_run_data import RunDataTables
from trainvitals.monitor.state_seqs import SeqTables
from trainvitals.monitor.state_writes import WRITES, StateWriteError

# SEQ_WINDOW, WRITES, the errors and alert_id are re-exported: the state file's API.
__all__ = ["SEQ_WINDOW", "WRITES", "StateDB", "StateInUse", "StateUnusable", "StateWriteError", "alert_id"]

log = logging.getLogger("trainvitals.monitor.state")


class StateDB(AlertTables, SeqTables, RunDataTables):
    """Runs, alert states, delivered notifications and applied reports in one SQLite file;
    thread-safe. Opening raises :class:`OSError`: :class:`StateInUse` when another
    collector holds the file, :class:`StateUnusable` when it is damaged, foreign or
    read-only, each a message naming the path. Writes raise :class:`StateWriteError`
    (logged and counted here), except :meth:`record_seqs`, which keeps what it could not
    write (:meth:`seqs_saved`)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self._memory = str(path) == ":memory:"
        self._fd: int | None = None  # the file itself, held open and flocked
        self._claim: socket.socket | None = None  # the resolved path's name, claimed
        self.on_recreated: list[Callable[[], None]] = []
        if self._memory:
            self._db = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
            self._db.executescript(SCHEMA)
            return
        shown = str(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(
                f"state_path {shown!r}: cannot create its folder: {exc.strerror}; "
                "set state_path to a writable file, or 'memory'"
            ) from None
        self._claim = claim_name(self.path)
        try:
            self._fd = open_locked(self.path)
            self._db = connect(self.path)
        except BaseException:
            self._release()
            raise

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
        fd = open_locked(tmp)
        if moved_aside:
            aside = path.with_name(f"{path.name}.replaced-{int(time.time())}")
            try:
                os.replace(path, aside)
                log.warning("state file %s: the file found there was moved to %s", str(path), str(aside))
            except FileNotFoundError:
                pass
        os.replace(tmp, path)
        old_db, old_fd = self._db, self._fd
        self._db, self._fd = connect(path), fd
        try:
            old_db.close()
        except sqlite3.Error:
            pass
        if old_fd is not None:
            os.close(old_fd)
