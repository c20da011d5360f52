"""The alert service's timer thread: calls a function every ``interval`` seconds.

A daemon thread (``trainvitals-alert-ticker``) that runs the service's ``tick``
(RunSilent, holds in seconds, expiry, re-sends, saving state) until stopped; a tick
that raises is logged and the next one runs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["Ticker"]

log = logging.getLogger("trainvitals.alerts")


class Ticker:
    """``tick()`` every ``interval`` s on a thread of its own, between :meth:`start` and :meth:`stop`."""

    def __init__(self, tick: Callable[[], object], interval: float, name: str = "trainvitals-alert-ticker") -> None:
        self._tick = tick
        self.interval = interval
        self.name = name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        """Start the thread (no-op while it runs)."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._tick()
            except Exception:
                log.exception("alert tick failed")

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread, waiting at most ``timeout`` s for a tick under way."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
