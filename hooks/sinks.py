"""Where reports go: one small interface, a null sink, a JSONL file, HTTP, and
TensorBoard (a report's headline figures, :mod:`trainvitals.hooks.headline`).

A sink is called from the sender thread only (:mod:`trainvitals.hooks.sender`),
never from the training step, with batches of encoded reports (one wire JSON
object each). It answers what happened to the batch; the sender owns queueing,
retries, backoff and the drop count. Nothing here raises into the caller.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal, Protocol

from trainvitals.hooks.headline import headline_figures
from trainvitals.wire.body import encode_body
from trainvitals.wire.redact import redact

__all__ = [
    "ENV_COLLECTOR",
    "ENV_TOKEN",
    "Delivery",
    "FileSink",
    "HttpSink",
    "NullSink",
    "Sink",
    "TensorBoardSink",
    "make_sink",
    "parse_sink",
]

log = logging.getLogger("trainvitals")

ENV_COLLECTOR = "TRAINVITALS_COLLECTOR"
ENV_TOKEN = "TRAINVITALS_TOKEN"

Delivery = Literal["sent", "retry", "refused"]
"""``sent``; ``retry``: a failure that may pass (the sender backs off and tries the
batch again); ``refused``: the destination will never take it (dropped, counted)."""


class Sink(Protocol):
    """A destination for batches of encoded reports."""

    max_batch_bytes: int
    """Largest batch to hand over at once (the sender splits by it)."""

    def deliver(self, batch: list[bytes]) -> Delivery: ...

    def close(self) -> None: ...


class NullSink:
    """Discards everything (``Monitor.latest()`` still works)."""

    max_batch_bytes = 1 << 62

    def deliver(self, batch: list[bytes]) -> Delivery:
        return "sent"

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return "NullSink()"


class FileSink:
    """Appends one report per line to a JSONL file (``trainvitals replay`` sends it)."""

    max_batch_bytes = 1 << 62

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._fh: Any = None
        self._failed = False

    def deliver(self, batch: list[bytes]) -> Delivery:
        try:
            if self._fh is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fh = open(self.path, "ab")
            self._fh.write(b"".join(r + b"\n" for r in batch))
            self._fh.flush()
        except OSError as exc:
            if not self._failed:
                self._failed = True
                log.warning("trainvitals: cannot write reports to %s (%s); dropping them", self.path, exc)
            return "refused"
        return "sent"

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __repr__(self) -> str:
        return f"FileSink({str(self.path)!r})"


class HttpSink:
    """POSTs batches to a collector's ``/v1/reports`` (gzip above ``gzip_min_bytes``).

    Connection errors, timeouts and 408/429/5xx are ``retry``; other 4xx mean the
    collector refuses the data (``refused``, the answer's detail logged once per
    state change).

    A slow collector cannot starve it: each timeout doubles the request timeout
    (up to ``max_timeout`` seconds) and halves the batch (down to one report), so
    the next try asks for less and waits longer; each success halves the timeout
    back towards ``timeout`` and doubles the batch back. Retried reports are
    applied once (the sender numbers them). The URL is logged without its password.

    ``on_answer``: called (on the sender thread) with the collector's parsed JSON
    answer to each accepted batch; the monitor sets it to receive live settings
    (docs/wire.md, "Live settings"). Its failures are logged once, never raised."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout: float = 5.0,
        max_batch_bytes: int = 4 * 1024 * 1024,
        gzip_min_bytes: int = 2048,
        max_timeout: float = 120.0,
    ):
        self.url = url.rstrip("/") + "/v1/reports"
        self._shown = redact(self.url)
        self._token = token if token is not None else os.environ.get(ENV_TOKEN)
        self.base_timeout = self.timeout = timeout
        self.max_timeout = max(max_timeout, timeout)
        self.base_batch_bytes = self.max_batch_bytes = max_batch_bytes
        self.gzip_min_bytes = gzip_min_bytes
        self._client: Any = None
        self._healthy = True
        self.problem: str | None = None
        """The last delivery problem in words (unreachable, refused), for the close summary."""
        self._refused_404 = 0
        self.on_answer: Callable[[dict[str, Any]], None] | None = None
        self._answer_failed = False
        self.unanswered = False
        """The last delivery was sent but got no answer (a read timeout): maybe applied."""

    def __repr__(self) -> str:
        return f"HttpSink({self._shown!r})"

    def _http(self) -> Any:
        if self._client is None:
            import httpx

            headers = {"Content-Type": "application/json", "User-Agent": "trainvitals-hooks"}
            if self._token:
                headers["Authorization"] = f"Bearer {self._token}"
            self._client = httpx.Client(timeout=self.timeout, headers=headers)
            # httpx logs each request's URL: never with the password in it.
            logging.getLogger("httpx").addFilter(_REDACT)
        return self._client

    def deliver(self, batch: list[bytes]) -> Delivery:
        body = encode_body(batch)
        headers = {}
        if len(body) >= self.gzip_min_bytes:
            body = gzip.compress(body, compresslevel=1)
            headers["Content-Encoding"] = "gzip"
        self.unanswered = False
        try:
            resp = self._http().post(self.url, content=body, headers=headers, timeout=self.timeout)
        except Exception as exc:  # noqa: BLE001 - connection refused, timeout, DNS: all transient
            import httpx

            # Sent whole, no answer: the collector may have applied it (the retry will tell).
            self.unanswered = isinstance(exc, (httpx.ReadTimeout, httpx.RemoteProtocolError))
            if isinstance(exc, httpx.TimeoutException):
                self._slower()
            self._set_health(False, f"collector {self._shown} unreachable ({type(exc).__name__}: {redact(str(exc))})")
            return "retry"
        if resp.status_code < 300:
            self._faster()
            self._set_health(True, f"collector {self._shown} reachable again")
            if self.on_answer is not None:
                self._answer(resp)
            return "sent"
        if resp.status_code in (408, 429) or resp.status_code >= 500:
            self._set_health(False, f"collector {self._shown} answered {resp.status_code}")
            return "retry"
        if resp.status_code == 404:
            self._refused_404 += len(batch)
            self.problem = self._not_found()
            if self._refused_404 == len(batch):  # once: every batch gets the same answer
                log.warning("trainvitals: %s; dropping the reports", self.problem)
            return "refused"
        self.problem = f"the collector {self._shown} refused them with {resp.status_code}"
        log.warning(
            "trainvitals: collector refused %d report(s) with %d: %s",
            len(batch),
            resp.status_code,
            redact(resp.text[:500]),
        )
        return "refused"

    def _not_found(self) -> str:
        """A 404: the URL is not a collector's ingest route; name it and the base URL to use."""
        from urllib.parse import urlsplit, urlunsplit

        parts = urlsplit(self.url)
        given = parts.path.removesuffix("/v1/reports")  # the path the user passed
        path = given
        while path.rstrip("/").endswith("/v1/reports"):
            path = path.rstrip("/").removesuffix("/v1/reports")
        root = urlunsplit((parts.scheme, parts.netloc, "", "", ""))
        if path != given:
            base = urlunsplit((parts.scheme, parts.netloc, path.rstrip("/"), "", ""))
            hint = f"the URL already ends in /v1/reports; pass the collector's base URL {redact(base)!r}"
        elif given.strip("/"):
            hint = f"is the collector at its base URL {redact(root)!r}? pass that (the hooks add /v1/reports)"
        else:
            hint = "no trainvitals collector answers there (another server on that port?)"
        return f"POST {self._shown} answered 404: {hint}"

    def _answer(self, resp: Any) -> None:
        """Hand the accepted batch's answer to ``on_answer`` (an answer without a JSON
        object, from an older collector or a proxy, is an empty one)."""
        try:
            answer = resp.json() if resp.content else {}
        except ValueError:
            answer = {}
        try:
            self.on_answer(answer if isinstance(answer, dict) else {})  # type: ignore[misc]
        except Exception as exc:  # noqa: BLE001 - the batch was delivered; never fail it
            if not self._answer_failed:
                self._answer_failed = True
                log.warning("trainvitals: could not read the collector's answer: %s", exc)

    @property
    def healthy(self) -> bool:
        """False while the collector is unreachable or failing (after one warning)."""
        return self._healthy

    def _slower(self) -> None:
        """After a timeout: wait twice as long, send half as much (the collector is slow)."""
        self.timeout = min(self.timeout * 2, self.max_timeout)
        self.max_batch_bytes = max(1, self.max_batch_bytes // 2)

    def _faster(self) -> None:
        self.timeout = max(self.base_timeout, self.timeout / 2)
        self.max_batch_bytes = min(self.base_batch_bytes, self.max_batch_bytes * 2)

    def _set_health(self, healthy: bool, message: str) -> None:
        if not healthy:
            self.problem = message
        if healthy != self._healthy:
            self._healthy = healthy
            if healthy:
                log.info("trainvitals: %s", message)
            else:
                log.warning("trainvitals: %s; reports are queued and retried", message)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class _RedactFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, ()
        return True


_REDACT = _RedactFilter()


class _SubmitSink:
    """Adapts a user's sink object with ``submit(report_json)``/``flush``/``close``."""

    max_batch_bytes = 1 << 62

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def deliver(self, batch: list[bytes]) -> Delivery:
        for report in batch:
            self.inner.submit(report)
        return "sent"

    def close(self) -> None:
        self.inner.flush(1.0)
        self.inner.close(1.0)

    def __repr__(self) -> str:
        return repr(self.inner)


class TensorBoardSink:
    """Writes each report's headline figures as TensorBoard scalars (event files in
    ``logdir``), at the report's step: ``attach(..., sink=TensorBoardSink("runs/x"))``
    or ``sink="tensorboard:runs/x"``. Runs on the sender thread, never in the step.

    ``also``: another sink that gets every report too (``"file:run.jsonl"`` to keep the
    reports for ``trainvitals check``/``report``; default the run's JSONL file is not
    written). Needs the ``tensorboard`` package (its writer: ``torch.utils.tensorboard``).
    """

    max_batch_bytes = 1 << 62

    def __init__(self, logdir: str | Path, *, also: Any = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # torch's writer needs the tensorboard package
            raise ImportError(
                f"TensorBoardSink needs the tensorboard package ({exc}); pip install tensorboard"
            ) from None
        self.logdir = Path(logdir)
        self._writer = SummaryWriter(log_dir=str(self.logdir))
        if isinstance(also, str):
            also = parse_sink(also)
        self.also = also
        self.firing: Callable[[], Iterable[str]] | None = None
        """Set by the monitor when the rules run in the job: the alerts firing now."""
        self._failed = False

    def deliver(self, batch: list[bytes]) -> Delivery:
        try:
            firing = list(self.firing()) if self.firing is not None else []
            for raw in batch:
                report = json.loads(raw)
                for name, value in headline_figures(report.get("samples", ()), firing).items():
                    self._writer.add_scalar(name, value, global_step=int(report["step"]))
            self._writer.flush()
        except Exception as exc:  # noqa: BLE001 - a tracker must never fail the reports
            if not self._failed:
                self._failed = True
                log.warning("trainvitals: cannot write TensorBoard figures to %s (%s)", self.logdir, exc)
        return self.also.deliver(batch) if self.also is not None else "sent"

    @property
    def path(self) -> Path | None:
        """The report file of ``also``, if it writes one (the verdict at close names it)."""
        return getattr(self.also, "path", None)

    def close(self) -> None:
        self._writer.close()
        if self.also is not None:
            self.also.close()

    def __repr__(self) -> str:
        return f"TensorBoardSink({str(self.logdir)!r})"


def make_sink(collector: str | None, sink: Any, run: str) -> Sink:
    """Resolve ``attach(collector=..., sink=...)`` into a sink object.

    Precedence: an explicit ``sink`` or ``collector``; else ``$TRAINVITALS_COLLECTOR``
    (a URL or ``file:PATH``); else ``./trainvitals-<run>.jsonl``.
    """
    if sink is not None and not isinstance(sink, str):
        if callable(getattr(sink, "deliver", None)) and callable(getattr(sink, "close", None)):
            given: Sink = sink
            return given
        for attr in ("submit", "flush", "close"):
            if not callable(getattr(sink, attr, None)):
                raise TypeError(
                    f"sink object {sink!r} has no deliver(batch) or {attr}(); pass a sink "
                    "string like 'file:run.jsonl' or 'null'"
                )
        return _SubmitSink(sink)
    spec = collector if collector is not None else sink
    if spec is None:
        spec = os.environ.get(ENV_COLLECTOR) or f"file:trainvitals-{run.replace('/', '_')}.jsonl"
    return parse_sink(spec)


def parse_sink(spec: str) -> Sink:
    """A sink from ``"null"``, ``"file:PATH"``, ``"tensorboard:DIR"`` or a collector URL."""
    if spec in ("null", "none", ""):
        return NullSink()
    if spec.startswith("file:"):
        path = spec[len("file:") :]
        if not path:
            raise ValueError("sink 'file:' needs a path, e.g. sink='file:/tmp/run.jsonl'")
        return FileSink(path)
    if spec.startswith(("http://", "https://")):
        return HttpSink(spec)
    if spec.startswith("tensorboard:"):
        logdir = spec[len("tensorboard:") :]
        if not logdir:
            raise ValueError("sink 'tensorboard:' needs a folder, e.g. sink='tensorboard:runs/exp1'")
        return TensorBoardSink(logdir)
    raise ValueError(
        f"cannot tell where to send reports from {spec!r}: pass collector='http://host:9477', "
        "sink='file:/path/run.jsonl', sink='tensorboard:DIR' or sink='null'"
    )
