"""Sending off the ingest path: one bounded queue and one worker thread per notifier.

``enqueue`` never blocks: a full queue drops the notification and counts it.
Each worker sends in order (a resolve never overtakes its trigger), batching
for receivers that take lists, and retries what can be retried with
exponential backoff and jitter (each wait drawn between half and all of the
exponential step, so workers that failed together do not retry together). A slow or dead receiver only delays its
own queue. Counters per notifier: ``sent``, ``failed`` (gave up or refused),
``dropped`` (queue full, or still queued at shutdown), ``retries``.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from trainvitals.alerts.notifiers.base import Notification, Notifier, NotifyError

__all__ = ["Dispatcher", "RetryPolicy"]

log = logging.getLogger("trainvitals.alerts")


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How a worker retries a failed send."""

    attempts: int = 5
    """Tries in all, the first included."""
    initial: float = 0.5
    """Seconds before the first retry (before jitter)."""
    maximum: float = 30.0
    """Cap on one wait, in seconds (also caps a receiver's Retry-After)."""
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("RetryPolicy.attempts must be at least 1")
        if self.initial < 0 or self.maximum < 0 or self.multiplier < 1:
            raise ValueError("RetryPolicy: initial and maximum must be >= 0, multiplier >= 1")

    def delay(self, retry: int, rng: random.Random, retry_after: float | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (0-based), jittered."""
        ceiling = min(self.maximum, self.initial * self.multiplier**retry)
        wait = rng.uniform(ceiling / 2, ceiling)
        if retry_after is not None:
            wait = max(wait, min(retry_after, self.maximum))
        return wait


class _Channel:
    """One notifier's queue, worker and counters."""

    def __init__(
        self,
        notifier: Notifier,
        size: int,
        policy: RetryPolicy,
        rng: random.Random,
        on_delivered: Callable[[str, list[Notification]], None] | None = None,
    ) -> None:
        self.notifier = notifier
        self.on_delivered = on_delivered
        self.queue: queue.Queue[Notification] = queue.Queue(maxsize=size)
        self.policy = policy
        self.rng = rng
        self.lock = threading.Lock()
        self.counts = {"sent": 0, "failed": 0, "dropped": 0, "retries": 0}
        self.thread: threading.Thread | None = None
        self.stop = threading.Event()
        self.deadline = float("inf")

    def count(self, outcome: str, n: int = 1) -> None:
        with self.lock:
            self.counts[outcome] += n

    def run(self) -> None:
        name = self.notifier.name
        while True:
            try:
                first = self.queue.get(timeout=0.1)
            except queue.Empty:
                if self.stop.is_set():
                    return
                continue
            batch = [first]
            while len(batch) < self.notifier.max_batch:
                try:
                    batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            if self.stop.is_set() and time.monotonic() > self.deadline:
                self.count("dropped", len(batch))
                continue
            self._send(batch, name)

    def _send(self, batch: list[Notification], name: str) -> None:
        policy = self.policy
        for attempt in range(policy.attempts):
            try:
                self.notifier.send(batch)
            except NotifyError as exc:
                last = attempt + 1 >= policy.attempts
                if not exc.retryable or last or (self.stop.is_set() and time.monotonic() > self.deadline):
                    self.count("failed", len(batch))
                    why = "not retryable" if not exc.retryable else f"after {attempt + 1} attempts"
                    log.warning("notifier %s: gave up on %d notification(s) (%s, %s)", name, len(batch), exc, why)
                    return
                self.count("retries")
                wait = policy.delay(attempt, self.rng, exc.retry_after)
                if self.stop.is_set():
                    wait = min(wait, max(0.0, self.deadline - time.monotonic()))
                self.stop.wait(wait)
            except Exception:  # a bug in a notifier must not kill its worker
                self.count("failed", len(batch))
                log.exception("notifier %s: unexpected error", name)
                return
            else:
                self.count("sent", len(batch))
                if self.on_delivered is not None:
                    try:
                        self.on_delivered(name, batch)
                    except Exception:
                        log.exception("notifier %s: recording the delivery failed", name)
                return


class Dispatcher:
    """Fans notifications out to notifiers without blocking the caller."""

    def __init__(
        self,
        notifiers: Iterable[Notifier],
        *,
        queue_size: int = 1000,
        retry: RetryPolicy | None = None,
        seed: int | None = None,
        on_delivered: Callable[[str, list[Notification]], None] | None = None,
    ) -> None:
        """``on_delivered(notifier name, batch)`` is called after each successful send
        (on that notifier's worker thread): the service records it for restarts."""
        if queue_size < 1:
            raise ValueError("queue_size must be at least 1")
        rng = random.Random(seed)
        policy = retry or RetryPolicy()
        self._channels = [_Channel(n, queue_size, policy, random.Random(rng.random()), on_delivered) for n in notifiers]
        self._started = False
        self._lock = threading.Lock()

    @property
    def notifiers(self) -> list[Notifier]:
        return [c.notifier for c in self._channels]

    def enqueue(self, notification: Notification) -> None:
        """Queue for every notifier that wants it; never blocks (full: dropped, counted)."""
        for ch in self._channels:
            if notification.repeat and not ch.notifier.wants_repeats:
                continue
            try:
                ch.queue.put_nowait(notification)
            except queue.Full:
                ch.count("dropped")

    def enqueue_to(self, name: str, notification: Notification) -> None:
        """Queue for the notifier called ``name`` only (restart reconciliation)."""
        for ch in self._channels:
            if ch.notifier.name == name:
                try:
                    ch.queue.put_nowait(notification)
                except queue.Full:
                    ch.count("dropped")

    def start(self) -> None:
        """Start one worker thread per notifier (idempotent)."""
        with self._lock:
            if self._started:
                return
            self._started = True
            for ch in self._channels:
                ch.thread = threading.Thread(target=ch.run, name=f"trainvitals-notify-{ch.notifier.name}", daemon=True)
                ch.thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Deliver what can be delivered within ``timeout`` seconds, then close the notifiers."""
        deadline = time.monotonic() + timeout
        for ch in self._channels:
            ch.deadline = deadline
            ch.stop.set()
        for ch in self._channels:
            if ch.thread is not None:
                ch.thread.join(max(0.0, deadline - time.monotonic()))
        for ch in self._channels:
            leftover = 0
            while True:
                try:
                    ch.queue.get_nowait()
                    leftover += 1
                except queue.Empty:
                    break
            if leftover:
                ch.count("dropped", leftover)
            ch.notifier.close()
            if ch.thread is not None:
                ch.thread.join(1.0)  # a request in flight fails fast once its client is closed

    def stats(self) -> dict[str, dict[str, int]]:
        """Per notifier: sent, failed, dropped, retries, queued."""
        out = {}
        for ch in self._channels:
            with ch.lock:
                counts = dict(ch.counts)
            counts["queued"] = ch.queue.qsize()
            out[ch.notifier.name] = counts
        return out
