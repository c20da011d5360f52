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
:meth:`close` takes ``timeout`` once for everything; a report sent without an
answer by then (in flight, or timed out: the collector may have applied it) is not
counted as dropped but as :attr:`Sender.unconfirmed`, and the drops counted at close
reach the collector in one last sample-free report when time is left.
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
from trainvitals.wire.schema import RUN_END_EVENT, Report, ends_run

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
        spill: Sink | None = None,
    ) -> None:
        self.sink = sink
        self.spill = spill
        """Where reports the sink never took go instead of being lost (a local file, for a
        collector that cannot be reached): those dropped from a full queue, and those still
        undelivered at close."""
        self.spilled = 0
        self._to_spill: list[bytes] = []
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
        self._in_flight = 0  # of which in a delivery
        # Outbox bodies sent once without an answer (a timeout): the collector may have them.
        self._maybe_applied: set[int] = set()
        self.unconfirmed = 0
        """Reports sent without an answer when :meth:`close` stopped waiting (maybe applied)."""
        self._last_head: dict[str, Any] | None = None  # run, rank, step of the latest report
        self._last_ended = False
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

    def wait_encoded(self, timeout: float) -> bool:
        """Wait (bounded) until every queued report is materialized and encoded (local
        work; deliveries may still be in flight); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending or (self._busy and self._busy != self._in_flight):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float, *, quiet: bool = False) -> int:
        """Flush, stop, and send the final drop count, all within ``timeout`` seconds
        together; what is left undelivered is counted as dropped and returned. ``quiet``:
        the caller says it (the monitor's close summary).

        Reports whose delivery is unknown (in flight when the time ran out, or retried
        after a timeout: the collector may have applied them) are not counted as
        dropped: :attr:`unconfirmed` holds how many. When the count grew at close, one
        last sample-free report carries it (and the run's end, if that was not
        delivered), so the collector's ``client_dropped_reports_total`` matches."""
        deadline = time.monotonic() + timeout
        # Keep a little of the time for that last report.
        self.flush(timeout * 0.8)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._cond:
            maybe = sum(1 for body in self._outbox if id(body) in self._maybe_applied)
            in_flight = self._in_flight if self._thread.is_alive() else 0
            left = len(self._pending) + len(self._outbox) - maybe + (self._busy - self._in_flight)
            self.unconfirmed = maybe + in_flight
            ended = self._last_ended and (left > 0 or self.unconfirmed > 0)
            self.dropped += left
            kept = [b for b in self._outbox if id(b) not in self._maybe_applied] if self.spill is not None else []
            kept, self._to_spill = self._to_spill + kept, []
            self._pending.clear()
            self._outbox.clear()
            self._outbox_bytes = 0
            self._closed = True
        if left and self._last_head is not None and not self._thread.is_alive():
            self._send_count(ended, deadline)
        self._spill_now(kept)
        if self.spilled:
            log.warning(
                "trainvitals: %d report(s) the collector never took are in %s: send them later with "
                "trainvitals replay %s --collector URL",
                self.spilled,
                getattr(self.spill, "path", self.spill),
                getattr(self.spill, "path", "FILE"),
            )
            try:
                self.spill.close()  # type: ignore[union-attr]
            except Exception:  # noqa: BLE001
                pass
        if (left or self.unconfirmed) and not quiet:
            # A warning, unless the sink already warned that the collector is unreachable.
            level = logging.INFO if getattr(self.sink, "healthy", True) is False else logging.WARNING
            log.log(
                level,
                "trainvitals: %d report(s) not delivered when the monitor closed "
                "(counted in client_dropped_reports_total)%s",
                left,
                f"; {self.unconfirmed} more sent without an answer (the collector may have applied them)"
                if self.unconfirmed
                else "",
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
            # Each packed report (torch tensors) is let go of once encoded, not when this
            # frame ends: a delivery below may block past the interpreter's exit, and a
            # tensor freed by a daemon thread once the interpreter is finalizing aborts the
            # process ("terminate called without an active exception").
            pending.reverse()
            while pending:
                self._encode(pending.pop())
            with self._cond:
                self._busy = 0
                self._cond.notify_all()
                if not self._outbox or time.monotonic() < self._retry_at:
                    continue
                batch = self._take_batch()
                self._busy = self._in_flight = len(batch)
            outcome = self._deliver(batch)
            with self._cond:
                self._in_flight = 0
                if self._closed:  # close() stopped waiting for this batch: unconfirmed until now
                    if outcome == "sent":
                        self.sent += len(batch)
                        settled = len(batch)
                    else:  # not delivered, unless a try of it went unanswered (maybe applied)
                        unanswered = getattr(self.sink, "unanswered", False)
                        settled = 0 if unanswered else sum(id(b) not in self._maybe_applied for b in batch)
                        self.dropped += settled
                    self.unconfirmed = max(0, self.unconfirmed - settled)
                    self._busy = 0
                    self._cond.notify_all()
                    return
                self._busy = 0
                if outcome == "sent":
                    self.sent += len(batch)
                    self._delay = self.backoff[0]
                elif outcome == "retry":
                    if getattr(self.sink, "unanswered", False):  # sent, no answer: maybe applied
                        self._maybe_applied.update(id(body) for body in batch)
                    for body in reversed(batch):  # back at the head; the byte bound still holds
                        self._outbox.appendleft(body)
                        self._outbox_bytes += len(body)
                    self._trim_locked()
                    self._retry_at = time.monotonic() + self._delay * (0.5 + random.random())
                    self._delay = min(self._delay * 2, self.backoff[1])
                else:
                    self.dropped += len(batch)
                self._cond.notify_all()
            if self._to_spill:
                self._spill_now()

    def _encode(self, item: PendingReport) -> None:
        try:
            report = item.materialize()
            dropped = {"name": "client_dropped_reports_total", "labels": {}, "value": float(self.dropped)}
            self._seq += 1
            validated = Report.model_validate(
                {**report, "samples": [*report["samples"], dropped], "sender": self.sender_id, "seq": self._seq}
            )
            data = encode_report(validated)
            self._last_head = {"run": validated.run, "rank": validated.rank, "step": validated.step}
            self._last_ended = ends_run(validated)
        except Exception as exc:  # noqa: BLE001 - never let a bad report kill the thread
            with self._cond:
                self.dropped += 1
            self._warn_once("encode", "could not send the report of step %s: %s", item.step, exc)
            return
        with self._cond:
            self._outbox.append(data)
            self._outbox_bytes += len(data)
            self._trim_locked()
        if self._to_spill:
            self._spill_now()
        if self.on_report is not None:
            try:
                self.on_report(validated)
            except Exception as exc:  # noqa: BLE001
                self._warn_once("on_report", "in-process rule evaluation failed: %s", exc)

    def _send_count(self, ended: bool, deadline: float) -> None:
        """One last report with the final drop count (and the run's end), sent by the
        caller of :meth:`close` within what is left of its time."""
        left = deadline - time.monotonic()
        if left <= 0.05:
            return
        dropped = {"name": "client_dropped_reports_total", "labels": {}, "value": float(self.dropped)}
        events = [{"kind": RUN_END_EVENT, "detail": "the run ended; its last reports were not delivered"}]
        self._seq += 1
        try:
            data = encode_report(
                Report.model_validate(
                    {
                        **(self._last_head or {}),
                        "time": time.time(),
                        "samples": [dropped],
                        "events": events if ended else [],
                        "sender": self.sender_id,
                        "seq": self._seq,
                    }
                )
            )
        except Exception as exc:  # noqa: BLE001 - never raise from close
            log.debug("trainvitals: the final drop count could not be built: %s", exc)
            return
        bounded = hasattr(self.sink, "timeout")
        saved = getattr(self.sink, "timeout", None)
        if bounded:
            self.sink.timeout = min(saved, left) if saved else left  # type: ignore[attr-defined]
        try:
            self._deliver([data])
        finally:
            if bounded:
                self.sink.timeout = saved  # type: ignore[attr-defined]

    def _trim_locked(self) -> None:
        """Drop the oldest reports until the outbox fits its byte bound (keeps the newest);
        with a spill, they are written there (by :meth:`_spill_now`, outside the lock)."""
        while self._outbox_bytes > self.max_queue_bytes and len(self._outbox) > 1:
            old = self._outbox.popleft()
            self._outbox_bytes -= len(old)
            self.dropped += 1
            if self.spill is not None:
                self._to_spill.append(old)

    def _spill_now(self, bodies: list[bytes] | None = None) -> None:
        """Write what was trimmed (or ``bodies``) to the spill; never raises."""
        if self.spill is None:
            return
        if bodies is None:
            with self._cond:
                bodies, self._to_spill = self._to_spill, []
        if not bodies:
            return
        try:
            if self.spill.deliver(bodies) == "sent":
                self.spilled += len(bodies)
        except Exception as exc:  # noqa: BLE001
            self._warn_once("spill", "could not keep undelivered reports in %r: %s", self.spill, exc)

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
