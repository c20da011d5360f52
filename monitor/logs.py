"""The collector's log hygiene: secrets redacted, repeated errors bounded.

:func:`install` puts two filters on the root handlers ``serve`` configures and on
uvicorn's own (its access log shows request paths, query strings included):

- :class:`RedactFilter`: every line passes through :func:`trainvitals.wire.redact.redact`
  (URL passwords, ``?token=`` values) and the secrets the notifiers registered;
- :class:`RepeatFilter`: the same message (by logger and format string) at most
  ``burst`` times per ``window`` seconds, then one line saying how many were
  suppressed. A flood of half-open connections or accept errors ("Too many open
  files") writes a few lines, not hundreds of MiB.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from trainvitals.alerts.notifiers.base import redact_secrets
from trainvitals.wire.redact import redact

__all__ = ["RedactFilter", "RepeatFilter", "install"]


def _clean(text: str) -> str:
    return redact_secrets(redact(text))


class RedactFilter(logging.Filter):
    """Rewrites a record's message with secrets replaced by ``***``.

    String arguments are cleaned in place, so formatters that read ``record.args``
    (uvicorn's access log: client, method, path, ...) still work; a secret hidden in
    another argument (an exception, a URL object) collapses the message into one clean
    string.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and record.args:
            record.args = tuple(_clean(a) if isinstance(a, str) else a for a in record.args)
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string: leave it to the handler
            return True
        clean = _clean(message)
        if record.exc_info and record.exc_text is None:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = _clean(record.exc_text)
        if clean != message:
            record.msg, record.args = clean, ()
        return True


class RepeatFilter(logging.Filter):
    """Lets the same message through at most ``burst`` times per ``window`` seconds."""

    def __init__(self, burst: int = 5, window: float = 60.0) -> None:
        super().__init__()
        self.burst, self.window = burst, window
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], list[Any]] = {}  # key -> [window start, count]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, str(record.msg))
        now = time.monotonic()
        with self._lock:
            slot = self._seen.get(key)
            if slot is None or now - slot[0] >= self.window:
                suppressed = slot[1] - self.burst if slot is not None and slot[1] > self.burst else 0
                self._seen[key] = [now, 1]
                if len(self._seen) > 10_000:
                    self._seen.clear()
                if suppressed:
                    record.msg = f"{record.msg} (and {suppressed} more like it in the last {self.window:.0f} s)"
                return True
            slot[1] += 1
            return bool(slot[1] <= self.burst)


# Loggers with handlers of their own (uvicorn configures them when its Config is built).
_OWN_HANDLERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


def install(burst: int = 5, window: float = 60.0) -> None:
    """Add the filters to every handler of the root logger and of uvicorn's loggers.

    Call after ``basicConfig`` and again once uvicorn's configuration is built (it adds
    its own handlers, the access log's among them); a handler is never filtered twice.
    """
    loggers = [logging.getLogger()] + [logging.getLogger(name) for name in _OWN_HANDLERS]
    for handler in {h for lg in loggers for h in lg.handlers}:
        if not any(isinstance(f, RedactFilter) for f in handler.filters):
            handler.addFilter(RedactFilter())
            handler.addFilter(RepeatFilter(burst, window))
