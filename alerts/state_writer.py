"""Writing the alert service's state as it changes, so that a restart finds it.

:class:`StateWriter` writes to an :class:`~trainvitals.alerts.persistence.AlertPersistence`
the engine's runs that changed (each tick), its alerts when any changed (at once after
a page or a resolve: a crash right after a page must not page again) and every batch a
notifier delivered. A failed write (the persistence logs and counts its own failures)
is tried again at the next :meth:`~StateWriter.save`, in full: every run, the alerts
and the deliveries not recorded yet. Reading the state back after a restart is
:mod:`trainvitals.alerts.reconcile`'s.
"""

from __future__ import annotations

import threading

from trainvitals.alerts.engine import Engine
from trainvitals.alerts.notifiers.base import Notification
from trainvitals.alerts.persistence import AlertPersistence

__all__ = ["StateWriter"]

MAX_UNRECORDED = 10_000
"""Delivered batches kept for a later write while the persistence fails; past it, dropped."""


class StateWriter:
    """What the service saves, and what it owes the persistence after a failure."""

    def __init__(self, engine: Engine, persistence: AlertPersistence) -> None:
        self.engine = engine
        self.persistence = persistence
        self._alerts_dirty = False
        self._resync = False  # a write failed or the file was recreated: save everything
        self._unrecorded: list[tuple[str, list[Notification]]] = []  # deliveries not written yet
        self._lock = threading.Lock()

    def alerts_changed(self) -> None:
        """The engine's alerts changed: the next :meth:`save` writes them."""
        self._alerts_dirty = True

    def save(self) -> None:
        """Write changed runs and, when any changed, the alerts; then the deliveries owed."""
        full = self._resync
        self._resync = False
        try:
            self.persistence.save_runs(self.engine.export_runs(dirty=not full))
        except Exception:  # noqa: BLE001 - any persistence: it logs and counts its own failures
            self._resync = True
        if self._alerts_dirty or full:
            self.save_alerts()
        with self._lock:
            owed, self._unrecorded = self._unrecorded, []
        for notifier, batch in owed:
            self.delivered(notifier, batch)

    def resync(self) -> None:
        """Write everything in full at the next :meth:`save` (the state file was recreated)."""
        self._resync = True
        self._alerts_dirty = True

    def save_alerts(self) -> None:
        """Write every alert now (a failure: again at the next :meth:`save`)."""
        self._alerts_dirty = False
        try:
            self.persistence.replace_alerts(self.engine.export_alerts())
        except Exception:  # noqa: BLE001 - any persistence: it logs and counts its own failures
            self._alerts_dirty = True  # logged and counted by the persistence; next tick again

    def delivered(self, notifier: str, batch: list[Notification]) -> None:
        """Record what ``notifier`` delivered (a dispatcher's ``on_delivered``)."""
        try:
            self.persistence.record_sent(notifier, batch)
        except Exception:  # noqa: BLE001 - any persistence: it logs and counts its own failures
            with self._lock:  # logged and counted by the persistence; recorded at the next save
                if len(self._unrecorded) < MAX_UNRECORDED:
                    self._unrecorded.append((notifier, batch))
