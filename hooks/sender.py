"""The sender: one background thread between the training step and a sink.

The training thread only calls :meth:`Sender.put` (an append under a lock). The
thread then, for each packed report: waits for its host copy and turns it into
samples (:meth:`PendingReport.materialize`), adds the client's drop counter,
validates it against the wire schema, encodes it, and keeps it in an outbox
bounded in bytes until the sink takes it. Failures that may pass are retried with
exponential backoff and jitter; a refusal drops the batch. Every report that is
not delivered, for whatever reason (outbox full, refused, invalid, still queued
at close), is counted once in :attr:`Sender.dropped` and reported as
``client_dropped_reports_total``. Nothing here raises into the training loop.

Each report carries ``sender`` (random, one per Sender) and ``seq`` (its number
from this sender): the collector applies a retried report once, so a retry after
a timeout (the collector got it, the answer did not arrive) cannot double it.
A report in flight when :meth:`close` stops waiting is counted as dropped, and
taken back off that count if its delivery completes after all.
"""

from __future__ import annotations

import logging
import random
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from trainvitals.hooks.pack import PendingReport
from trainvitals.hooks.sinks import Sink
from trainvitals.wire.body import encode_report
from trainvitals.wire.schema import Report

__all__ = ["Sender"]

log = logging.getLogger("trainvitals")

DEFAULT_QUEUE_BYTES = 64 * 1024 * 1024


class Sender:
    """Materializes, validates, encodes and delivers reports on one thread.

    ``max_queue_bytes`` bounds the encoded reports waiting for the sink (oldest
    dropped first: fresh data matters most); ``max_pending`` bounds the packed
    reports not yet encoded. ``backoff``: first and largest wait between retries,
    in seconds. ``on_report`` sees every validated report (in-process alert rules).
    """

    def __init__(
        self,
        sink: Sink,
        *,
        max_queue_bytes: int = DEFAULT_QUEUE_BYTES,
        max_pending: int = 256,
        backoff: tuple[float, float] = (0.2, 30.0),
        on_report: Callable[[Report], Any] | None = None,
    ) -> None:
        self.sink = sink
        self.max_queue_bytes = max_queue_bytes
        self.max_pending = max_pending
        self.backoff = backoff
        self.on_report = on_report
        self.dropped = 0
        self.sent = 0
        self.sender_id = secrets.token_hex(8)
        self._seq = 0
        self._closed = False  # close() has counted what was left
        self._pending: deque[PendingReport] = deque()
        self._outbox: deque[bytes] = deque()
        self._outbox_bytes = 0
        self._busy = 0  # reports the thread holds outside the queues (encoding, in flight)
        self._retry_at = 0.0
        self._delay = backoff[0]
        self._stop = False
        self._warned: set[str] = set()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="trainvitals-sender", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"Sender({self.sink!r})"

    # -- the training thread ---------------------------------------------------
    def put(self, report: PendingReport) -> None:
        """Queue a packed report; never blocks (a full queue drops the oldest, counted)."""
        with self._cond:
            if self._stop:
                self.dropped += 1
                return
            if len(self._pending) >= self.max_pending:
                self._pending.popleft()
                self.dropped += 1
            self._pending.append(report)
            self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait (bounded) until everything queued was delivered or dropped; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._retry_at = min(self._retry_at, time.monotonic())  # a flush retries at once
            self._cond.notify_all()
            while self._pending or self._outbox or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float, *, quiet: bool = False) -> int:
        """Flush with a bounded wait, then stop; what is left is counted as dropped and
        returned. ``quiet``: the caller says it (the monitor's close summary)."""
        self.flush(timeout)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=max(0.1, min(timeout, 10.0)))
        with self._cond:
            # Still queued, or in flight when we gave up waiting: not delivered (an
            # in-flight batch that does arrive later is taken back off, see _run).
            left = len(self._pending) + len(self._outbox) + self._busy
            self.dropped += left
            self._pending.clear()
            self._outbox.clear()
            self._outbox_bytes = 0
            self._closed = True
        if left and not quiet:
            # A warning, unless the sink already warned that the collector is unreachable.
            level = logging.INFO if getattr(self.sink, "healthy", True) is False else logging.WARNING
            log.log(
                level,
                "trainvitals: %d report(s) not delivered when the monitor closed "
                "(counted in client_dropped_reports_total)",
                left,
            )
        try:
            self.sink.close()
        except Exception as exc:  # noqa: BLE001
            log.warning("trainvitals: closing the sink failed: %s", exc)
        return left

    # -- the sender thread -----------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while (
                    not self._stop and not self._pending and not (self._outbox and time.monotonic() >= self._retry_at)
                ):
                    wait = self._retry_at - time.monotonic() if self._outbox else None
                    self._cond.wait(wait)
                if self._stop:
                    return
                pending = list(self._pending)
                self._pending.clear()
                self._busy = len(pending)
            for item in pending:
                self._encode(item)
            with self._cond:
                self._busy = 0
                self._cond.notify_all()
                if not self._outbox or time.monotonic() < self._retry_at:
                    continue
                batch = self._take_batch()
                self._busy = len(batch)
            outcome = self._deliver(batch)
            with self._cond:
                if self._closed:  # close() gave up on this batch and counted it as dropped
                    if outcome == "sent":
                        self.dropped -= len(batch)
                        self.sent += len(batch)
                    self._busy = 0
                    self._cond.notify_all()
                    return
                self._busy = 0
                if outcome == "sent":
                    self.sent += len(batch)
                    self._delay = self.backoff[0]
                elif outcome == "retry":
                    for body in reversed(batch):  # back at the head; the byte bound still holds
                        self._outbox.appendleft(body)
                        self._outbox_bytes += len(body)
                    self._trim_locked()
                    self._retry_at = time.monotonic() + self._delay * (0.5 + random.random())
                    self._delay = min(self._delay * 2, self.backoff[1])
                else:
                    self.dropped += len(batch)
                self._cond.notify_all()

    def _encode(self, item: PendingReport) -> None:
        try:
            report = item.materialize()
            dropped = {"name": "client_dropped_reports_total", "labels": {}, "value": float(self.dropped)}
            self._seq += 1
            validated = Report.model_validate(
                {**report, "samples": [*report["samples"], dropped], "sender": self.sender_id, "seq": self._seq}
            )
            data = encode_report(validated)
        except Exception as exc:  # noqa: BLE001 - never let a bad report kill the thread
            with self._cond:
                self.dropped += 1
            self._warn_once("encode", "could not send the report of step %s: %s", item.step, exc)
            return
        with self._cond:
            self._outbox.append(data)
            self._outbox_bytes += len(data)
            self._trim_locked()
        if self.on_report is not None:
            try:
                self.on_report(validated)
            except Exception as exc:  # noqa: BLE001
                self._warn_once("on_report", "in-process rule evaluation failed: %s", exc)

    def _trim_locked(self) -> None:
        """Drop the oldest reports until the outbox fits its byte bound (keeps the newest)."""
        while self._outbox_bytes > self.max_queue_bytes and len(self._outbox) > 1:
            old = self._outbox.popleft()
            self._outbox_bytes -= len(old)
            self.dropped += 1

    def _take_batch(self) -> list[bytes]:
        batch: list[bytes] = []
        size = 0
        limit = self.sink.max_batch_bytes
        while self._outbox and (not batch or size + len(self._outbox[0]) <= limit):
            item = self._outbox.popleft()
            self._outbox_bytes -= len(item)
            size += len(item)
            batch.append(item)
        return batch

    def _deliver(self, batch: list[bytes]) -> str:
        try:
            return self.sink.deliver(batch)
        except Exception as exc:  # noqa: BLE001 - a broken sink drops, never kills the thread
            self._warn_once("deliver", "the sink %r failed: %s", self.sink, exc)
            return "refused"

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("trainvitals: " + message, *args)
