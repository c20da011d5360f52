"""Writing the state file: one transaction per write, and what a failed write does.

:class:`StateWrites` is the base of :class:`~trainvitals.monitor.state_db.StateDB` and
of its tables (alerts, reports applied, per-run data): the connection, its lock, and
the bookkeeping of failures. A failed write is logged (each kind of write with its own
line and repeat budget), counted (``trainvitals_collector_state_write_errors_total{write}``)
and makes :attr:`StateWrites.problem` say why (``/readyz`` answers degraded).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

from trainvitals.wire import METRICS, PREFIX
from trainvitals.wire.errors import StateError

__all__ = ["WRITES", "StateWriteError", "StateWrites"]

log = logging.getLogger("trainvitals.monitor.state")

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


class StateWriteError(StateError):
    """A write to the state file failed (disk full, file gone read-only...); logged and
    counted by the :class:`StateDB` that raised it."""


class StateWrites:
    """The connection, its lock and the write bookkeeping; the tables build on it."""

    _db: sqlite3.Connection
    """Set by the subclass that opens the file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.RLock()
        self.write_errors = dict.fromkeys(WRITES, 0)
        self._failing: dict[str, str] = {}  # kind of write -> why it failed last
        self._lost: str | None = None  # the file is gone or replaced and not yet written back

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
