"""Where reports go: one small interface, a null sink, a JSONL file, and HTTP.

Sinks run on the sender side only: ``submit`` is called from the Monitor's
pipeline thread, never from the training step. Nothing here raises into the
caller; failures are logged once per state change and counted as drops.
"""

from __future__ import annotations

import gzip
import logging
import os
import random
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Protocol

from trainvitals.wire import SCHEMA_VERSION

log = logging.getLogger("trainvitals")

DEFAULT_QUEUE_BYTES = 64 * 1024 * 1024
ENV_COLLECTOR = "TRAINVITALS_COLLECTOR"
ENV_TOKEN = "TRAINVITALS_TOKEN"


class Sink(Protocol):
    """A destination for encoded reports (one JSON object each)."""

    dropped: int

    def submit(self, report_json: bytes) -> None: ...

    def flush(self, timeout: float) -> bool: ...

    def close(self, timeout: float) -> None: ...


class NullSink:
    """Discards everything (``Monitor.latest()`` still works)."""

    dropped = 0

    def submit(self, report_json: bytes) -> None:
        pass

    def flush(self, timeout: float) -> bool:
        return True

    def close(self, timeout: float) -> None:
        pass

    def __repr__(self) -> str:
        return "NullSink()"


class FileSink:
    """Appends one report per line to a JSONL file (``trainvitals replay`` sends it)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.dropped = 0
        self._fh = None
        self._failed = False

    def submit(self, report_json: bytes) -> None:
        try:
            if self._fh is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fh = open(self.path, "ab")
            self._fh.write(report_json + b"\n")
            self._fh.flush()
        except OSError as exc:
            self.dropped += 1
            if not self._failed:
                self._failed = True
                log.warning("trainvitals: cannot write reports to %s (%s); dropping them", self.path, exc)

    def flush(self, timeout: float) -> bool:
        return True

    def close(self, timeout: float) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __repr__(self) -> str:
        return f"FileSink({str(self.path)!r})"


class HttpSink:
    """POSTs batches of reports to a collector from a background thread.

    The queue is bounded in bytes; when it is full the oldest reports are dropped
    (fresh data matters most) and counted. Transient failures (connection errors,
    408/429/5xx) are retried with exponential backoff and jitter; other 4xx answers
    mean the collector refuses the data, so that batch is dropped and logged.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        max_queue_bytes: int = DEFAULT_QUEUE_BYTES,
        max_batch_bytes: int = 4 * 1024 * 1024,
        timeout: float = 5.0,
        backoff: tuple[float, float] = (0.2, 30.0),
        gzip_min_bytes: int = 2048,
    ):
        self.url = url.rstrip("/") + "/v1/reports"
        self._token = token if token is not None else os.environ.get(ENV_TOKEN)
        self.max_queue_bytes = max_queue_bytes
        self.max_batch_bytes = max_batch_bytes
        self.timeout = timeout
        self.backoff = backoff
        self.gzip_min_bytes = gzip_min_bytes
        self.dropped = 0
        self.sent = 0
        self._queue: deque[bytes] = deque()
        self._queued_bytes = 0
        self._inflight = 0
        self._cond = threading.Condition()
        self._stop = False
        self._healthy = True
        self._thread = threading.Thread(target=self._run, name="trainvitals-http", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"HttpSink({self.url!r})"

    def submit(self, report_json: bytes) -> None:
        with self._cond:
            self._queue.append(report_json)
            self._queued_bytes += len(report_json)
            self._trim_locked()
            self._cond.notify()

    def flush(self, timeout: float) -> bool:
        """Wait until everything queued was delivered or dropped; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float) -> None:
        """Flush with a bounded wait, then stop; what is left is counted as dropped."""
        self.flush(timeout)
        with self._cond:
            self._stop = True
            self.dropped += len(self._queue)
            self._queue.clear()
            self._queued_bytes = 0
            self._cond.notify_all()
        self._thread.join(timeout=max(0.1, min(timeout, self.timeout + 1)))

    def _trim_locked(self) -> None:
        """Drop the oldest reports until the queue fits its byte bound (keeps the newest)."""
        while self._queued_bytes > self.max_queue_bytes and len(self._queue) > 1:
            old = self._queue.popleft()
            self._queued_bytes -= len(old)
            self.dropped += 1

    # -- sender thread -------------------------------------------------------
    def _take_batch(self) -> list[bytes]:
        batch: list[bytes] = []
        size = 0
        while self._queue and (not batch or size + len(self._queue[0]) <= self.max_batch_bytes):
            item = self._queue.popleft()
            self._queued_bytes -= len(item)
            size += len(item)
            batch.append(item)
        return batch

    def _run(self) -> None:
        import httpx

        headers = {"Content-Type": "application/json", "User-Agent": "trainvitals-hooks"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        delay = self.backoff[0]
        with httpx.Client(timeout=self.timeout, headers=headers) as client:
            while True:
                with self._cond:
                    while not self._queue and not self._stop:
                        self._cond.wait()
                    if self._stop:
                        return
                    batch = self._take_batch()
                    self._inflight = len(batch)
                outcome = self._post(client, batch)
                with self._cond:
                    self._inflight = 0
                    if outcome == "retry" and not self._stop:
                        # Put the batch back at the head; the byte bound still holds.
                        for item in reversed(batch):
                            self._queue.appendleft(item)
                            self._queued_bytes += len(item)
                        self._trim_locked()
                    elif outcome == "retry":
                        self.dropped += len(batch)
                    self._cond.notify_all()
                    if outcome == "retry":
                        self._cond.wait(delay * (0.5 + random.random()))
                        delay = min(delay * 2, self.backoff[1])
                    else:
                        delay = self.backoff[0]

    def _post(self, client: Any, batch: list[bytes]) -> str:
        body = b'{"schema":%d,"reports":[' % SCHEMA_VERSION + b",".join(batch) + b"]}"
        headers = {}
        if len(body) >= self.gzip_min_bytes:
            body = gzip.compress(body, compresslevel=1)
            headers["Content-Encoding"] = "gzip"
        try:
            resp = client.post(self.url, content=body, headers=headers)
        except Exception as exc:  # connection refused, timeout, DNS: all transient
            self._set_health(False, f"collector {self.url} unreachable ({type(exc).__name__}: {exc})")
            return "retry"
        if resp.status_code < 300:
            self.sent += len(batch)
            self._set_health(True, f"collector {self.url} reachable again")
            return "ok"
        if resp.status_code in (408, 429) or resp.status_code >= 500:
            self._set_health(False, f"collector {self.url} answered {resp.status_code}")
            return "retry"
        with self._cond:
            self.dropped += len(batch)
        detail = resp.text[:500]
        log.warning("trainvitals: collector refused %d report(s) with %d: %s", len(batch), resp.status_code, detail)
        return "refused"

    def _set_health(self, healthy: bool, message: str) -> None:
        if healthy != self._healthy:
            self._healthy = healthy
            if healthy:
                log.info("trainvitals: %s", message)
            else:
                log.warning("trainvitals: %s; reports are queued and retried (%d dropped so far)", message, self.dropped)


def make_sink(collector: str | None, sink: Any, run: str, *, queue_bytes: int = DEFAULT_QUEUE_BYTES) -> Any:
    """Resolve ``attach(collector=..., sink=...)`` into a sink object.

    Precedence: an explicit ``sink`` or ``collector``; else ``$TRAINVITALS_COLLECTOR``
    (a URL or ``file:PATH``); else ``./trainvitals-<run>.jsonl``.
    """
    if sink is not None and not isinstance(sink, str):
        for attr in ("submit", "flush", "close"):
            if not callable(getattr(sink, attr, None)):
                raise TypeError(f"sink object {sink!r} has no {attr}(); pass a sink string like 'file:run.jsonl' or 'null'")
        return sink
    spec = collector if collector is not None else sink
    if spec is None:
        spec = os.environ.get(ENV_COLLECTOR) or f"file:trainvitals-{run.replace('/', '_')}.jsonl"
    return parse_sink(spec, queue_bytes=queue_bytes)


def parse_sink(spec: str, *, queue_bytes: int = DEFAULT_QUEUE_BYTES) -> Any:
    if spec in ("null", "none", ""):
        return NullSink()
    if spec.startswith("file:"):
        path = spec[len("file:"):]
        if not path:
            raise ValueError("sink 'file:' needs a path, e.g. sink='file:/tmp/run.jsonl'")
        return FileSink(path)
    if spec.startswith(("http://", "https://")):
        return HttpSink(spec, max_queue_bytes=queue_bytes)
    raise ValueError(
        f"cannot tell where to send reports from {spec!r}: pass collector='http://host:9477', "
        "sink='file:/path/run.jsonl' or sink='null'"
    )


__all__ = ["Sink", "NullSink", "FileSink", "HttpSink", "make_sink", "parse_sink"]
