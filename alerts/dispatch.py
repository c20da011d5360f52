"""Sending off the ingest path: one bounded queue and one worker thread per notifier.

``enqueue`` never blocks: a full queue drops a notification of the run with the most
queued (never another run's) and counts it.
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
from collections import deque
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


class _FairQueue:
    """A bounded FIFO of notifications, fair between runs: when it is full, a notification
    of a run with fewer queued than the busiest run evicts that run's newest one, so a run
    that floods (one rule opening thousands of alerts) cannot drop another run's pages;
    only the busiest run's own notifications are dropped. ``queue.Queue``'s methods."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._items: deque[Notification] = deque()
        self._per_run: dict[str, int] = {}
        self._cond = threading.Condition()

    @staticmethod
    def _run(n: Notification) -> str:
        return n.labels.get("run", "")

    def put_nowait(self, item: Notification) -> int:
        """Queue ``item``; return how many were evicted for it (0 or 1). Raises
        ``queue.Full`` when ``item``'s own run is the busiest (it is the one dropped)."""
        run = self._run(item)
        evicted = 0
        with self._cond:
            if len(self._items) >= self.maxsize:
                busiest = max(self._per_run, key=self._per_run.__getitem__)
                if self._per_run.get(run, 0) + 1 >= self._per_run[busiest]:
                    raise queue.Full
                for i in range(len(self._items) - 1, -1, -1):
                    if self._run(self._items[i]) == busiest:
                        del self._items[i]
                        self._forget(busiest)
                        evicted = 1
                        break
            self._items.append(item)
            self._per_run[run] = self._per_run.get(run, 0) + 1
            self._cond.notify()
        return evicted

    def _forget(self, run: str) -> None:
        left = self._per_run[run] - 1
        if left:
            self._per_run[run] = left
        else:
            del self._per_run[run]

    def get(self, timeout: float) -> Notification:
        with self._cond:
            if not self._items and not self._cond.wait_for(lambda: self._items, timeout):
                raise queue.Empty
            return self._pop()

    def get_nowait(self) -> Notification:
        with self._cond:
            if not self._items:
                raise queue.Empty
            return self._pop()

    def _pop(self) -> Notification:
        item = self._items.popleft()
        self._forget(self._run(item))
        return item

    def qsize(self) -> int:
        with self._cond:
            return len(self._items)


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
        self.queue = _FairQueue(size)
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
            self._put(ch, notification)

    @staticmethod
    def _put(ch: _Channel, notification: Notification) -> None:
        try:
            evicted = ch.queue.put_nowait(notification)
        except queue.Full:
            evicted = 1
        if evicted:
            ch.count("dropped", evicted)

    def enqueue_to(self, name: str, notification: Notification) -> None:
        """Queue for the notifier called ``name`` only (restart reconciliation)."""
        for ch in self._channels:
            if ch.notifier.name == name:
                self._put(ch, notification)

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
