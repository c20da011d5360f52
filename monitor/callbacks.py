"""Ingest subscriptions: who is told of every batch the store applied (the alert rules,
the state file's memory of the reports applied), and how.

:meth:`SeriesStore.on_ingest <trainvitals.monitor.store.SeriesStore.on_ingest>`
registers a callback here and hands back its :class:`RemovableHandle`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from trainvitals.monitor.handles import RemovableHandle
from trainvitals.wire import Report

if TYPE_CHECKING:
    from trainvitals.monitor.decode import WireReport

__all__ = ["Applied", "IngestCallback", "IngestCallbacks", "IngestedBatch"]

# The store's logger: a failing callback is a store event for whoever reads the log.
log = logging.getLogger("trainvitals.monitor.store")


class IngestedBatch(Protocol):
    """What ``on_ingest`` callbacks get: the reports applied, as the wire's pydantic models
    (:meth:`SeriesStore.apply` of a ``ReportBatch``) or as the collector decoder's structs
    (the ingest route's ``WireBatch``); both have the same attributes."""

    @property
    def reports(self) -> Sequence[Report] | Sequence[WireReport]: ...


# Called as callback(batch, now); what it returns is ignored.
IngestCallback = Callable[[IngestedBatch, float], object]


class Applied:
    """The reports of a batch that were applied (what on_ingest callbacks get when some
    reports of the batch were skipped)."""

    __slots__ = ("reports",)

    def __init__(self, reports: list[Report] | list[WireReport]) -> None:
        self.reports = reports


class IngestCallbacks:
    """The callbacks, in registration order; thread-safe."""

    __slots__ = ("_callbacks", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: tuple[IngestCallback, ...] = ()

    def add(self, callback: IngestCallback) -> RemovableHandle:
        with self._lock:
            self._callbacks = (*self._callbacks, callback)

        def remove() -> None:
            with self._lock:
                if callback in self._callbacks:
                    i = self._callbacks.index(callback)
                    self._callbacks = self._callbacks[:i] + self._callbacks[i + 1 :]

        return RemovableHandle(remove)

    def snapshot(self) -> tuple[IngestCallback, ...]:
        """The callbacks now (a tuple: registering later changes nothing of it)."""
        return self._callbacks

    @staticmethod
    def call(callbacks: Sequence[IngestCallback], batch: IngestedBatch, now: float) -> None:
        """Call each; an exception is logged and never reaches the ingest."""
        for cb in callbacks:
            try:
                cb(batch, now)
            except Exception:
                log.exception("on_ingest callback %r failed; the batch was still ingested", cb)
