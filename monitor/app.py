"""The collector's HTTP edge: ingest, ``/metrics``, runs, health.

A thin FastAPI layer over :class:`SeriesStore` and :class:`StoreCollector`.
Other components hook in after :func:`create_app`::

    app = create_app(settings)
    app.state.store.on_ingest(engine.on_batch)                    # see every accepted batch
    app.state.exporter.register_family_source(engine.families)  # add families to /metrics
    app.include_router(alerts_router)                             # more endpoints
"""

from __future__ import annotations

import gc
import gzip
import logging
import secrets
import time
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from trainvitals.alerts.service import AlertService
from trainvitals.monitor.exposition import ReportCounter, StoreCollector
from trainvitals.monitor.settings import Settings, SettingsError
from trainvitals.monitor.store import IngestRefused, SeriesLimitExceeded, SeriesStore
from trainvitals.wire import SCHEMA_VERSION, ReportBatch

__all__ = ["create_app", "tune_gc"]

log = logging.getLogger(__name__)

_MAX_ERRORS_SHOWN = 10
_GZIP_MIN_BYTES = 64 * 1024  # gzip /metrics responses only when worth the CPU


class _Refused(Exception):
    """An ingest refusal: HTTP status, outcome label, detail."""

    def __init__(
        self, status: int, outcome: str, detail: str, headers: dict[str, str] | None = None
    ):
        super().__init__(detail)
        self.status = status
        self.outcome = outcome
        self.detail = detail
        self.headers = headers


def create_app(settings: Settings | None = None, *, store: SeriesStore | None = None,
               alerts: AlertService | None = None) -> FastAPI:
    """Build the collector app; ``settings`` default to the environment.

    ``app.state`` holds ``settings``, ``store``, ``exporter`` (the
    :class:`StoreCollector` that renders ``/metrics``) and ``reports`` (the
    :class:`ReportCounter`).
    """
    if settings is None:
        settings = Settings()
    if store is None:
        store = SeriesStore(ttl_seconds=settings.run_ttl_seconds, max_series=settings.max_series)
    reports = ReportCounter()
    exporter = StoreCollector(store, reports)
    if alerts is None:
        alerts = _alert_service(settings)
    # Rules are evaluated as reports arrive (cheap, no I/O); notifiers send from their own threads.
    store.on_ingest(alerts.observe_batch)
    exporter.register_family_source(alerts.metric_families)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        alerts.start()
        app.state.ready = True
        try:
            yield
        finally:
            app.state.ready = False
            await run_in_threadpool(alerts.stop)

    app = FastAPI(
        title="trainvitals collector",
        summary="Ingests training-health reports and exports them to Prometheus.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.store = store
    app.state.exporter = exporter
    app.state.reports = reports
    app.state.alerts = alerts
    app.state.ready = False

    token = settings.token.get_secret_value().encode() if settings.token is not None else None
    max_body = settings.max_body_bytes
    max_decoded = settings.max_decompressed_bytes

    @app.post("/v1/reports", status_code=202)
    async def ingest_reports(request: Request) -> Response:
        """Ingest a batch of reports (DESIGN "Wire format")."""
        try:
            _check_token(request, token)
            _check_content_type(request)
            body = await _read_body(request, max_body)
            body = _decode(request, body, max_decoded)
            batch = _parse(body)
            try:
                n = store.ingest(batch, time.time())
            except SeriesLimitExceeded as exc:
                raise _Refused(422, "series_limit", str(exc)) from None
            except IngestRefused as exc:
                raise _Refused(422, "invalid", str(exc)) from None
        except _Refused as exc:
            reports.inc(exc.outcome)
            client = request.client.host if request.client else "?"
            log.info("refused a report body from %s: %d %s", client, exc.status, exc.detail)
            return JSONResponse({"detail": exc.detail}, exc.status, headers=exc.headers)
        reports.inc("accepted", n)
        return JSONResponse({"accepted": n}, 202)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Prometheus text exposition."""
        gz = "gzip" in request.headers.get("accept-encoding", "")
        data, encoded = await run_in_threadpool(_render, exporter, gz)
        headers = {"Content-Encoding": "gzip", "Vary": "Accept-Encoding"} if encoded else None
        return Response(data, media_type=CONTENT_TYPE_LATEST, headers=headers)

    @app.get("/v1/runs")
    async def runs() -> list[dict[str, Any]]:
        """Live runs: last step, last report time (collector clock), ranks seen."""
        return [
            {
                "run": r.run,
                "step": r.step,
                "last_report_time": r.last_report_time,
                "ranks": list(r.ranks),
                "ended": r.ended,
            }
            for r in store.runs()
        ]

    @app.get("/v1/alerts")
    async def list_alerts() -> list[dict[str, Any]]:
        """Alerts firing now, pending, or resolved recently."""
        return alerts.alerts()

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        """The process answers."""
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Response:
        """Started and able to ingest."""
        if not app.state.ready:
            return JSONResponse({"status": "starting"}, 503)
        return JSONResponse({"status": "ready", "series": len(store)})

    return app


def _alert_service(settings: Settings) -> AlertService:
    """The alert service the settings describe; a bad rule or notifier raises SettingsError."""
    from trainvitals.alerts.notifiers.config import NotifierConfigError
    from trainvitals.alerts.rules import RuleError

    options = dict(settings.alerts or {})
    options.setdefault("run_ttl", settings.run_ttl_seconds)
    rules = "default" if settings.rules is None else settings.rules
    try:
        return AlertService.from_config(rules=rules, notifiers=settings.notifiers, **options)
    except (RuleError, NotifierConfigError) as exc:
        raise SettingsError(str(exc)) from None
    except TypeError as exc:
        raise SettingsError(f"alerts: unknown option ({exc}); see AlertService.from_config") from None


def tune_gc() -> None:
    """Tune the garbage collector for a process that serves the collector.

    Validation allocates a few objects per sample; with the default gen-0
    threshold (700) a 2,000-sample report triggers several collections, each
    also walking young store entries. Freezing what startup allocated and
    collecting gen 0 every 100,000 allocations cut ingest CPU by 10-30% here.
    Process-wide, so ``serve`` calls it; ``create_app`` does not.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)


def _render(exporter: StoreCollector, gz: bool) -> tuple[bytes, bool]:
    data = exporter.render()
    if gz and len(data) >= _GZIP_MIN_BYTES:
        return gzip.compress(data, compresslevel=1), True
    return data, False


def _check_token(request: Request, token: bytes | None) -> None:
    if token is None:
        return
    header = request.headers.get("authorization")
    if header is None:
        raise _Refused(
            401,
            "unauthorized",
            "missing bearer token: send 'Authorization: Bearer <token>'",
            {"WWW-Authenticate": 'Bearer realm="trainvitals"'},
        )
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), token):
        raise _Refused(
            401,
            "unauthorized",
            "invalid bearer token",
            {"WWW-Authenticate": 'Bearer realm="trainvitals", error="invalid_token"'},
        )


def _check_content_type(request: Request) -> None:
    ctype = request.headers.get("content-type", "")
    media = ctype.split(";", 1)[0].strip().lower()
    if media != "application/json":
        shown = repr(ctype) if ctype else "none"
        raise _Refused(
            415, "unsupported_media", f"Content-Type {shown} not supported; send application/json"
        )
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("identity", "gzip", ""):
        raise _Refused(
            415,
            "unsupported_media",
            f"Content-Encoding {encoding!r} not supported; send gzip or no encoding",
        )


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise _Refused(400, "invalid", f"Content-Length {declared!r} is not a number") from None
        if size > limit:
            raise _Refused(
                413, "too_large", f"body of {size} bytes exceeds the limit of {limit} bytes"
            )
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise _Refused(
                413, "too_large", f"body exceeds the limit of {limit} bytes (max_body_bytes)"
            )
        chunks.append(chunk)
    return b"".join(chunks)


def _decode(request: Request, body: bytes, limit: int) -> bytes:
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding != "gzip":
        return body
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)  # 16+: gzip header and trailer
    try:
        out = inflater.decompress(body, limit)
        if inflater.unconsumed_tail:
            raise _Refused(
                413,
                "too_large",
                f"gzip body inflates past the limit of {limit} bytes (max_decompressed_bytes)",
            )
        out += inflater.flush()
    except zlib.error as exc:
        raise _Refused(400, "bad_gzip", f"body is not valid gzip: {exc}") from None
    if len(out) > limit:
        raise _Refused(413, "too_large", f"gzip body inflates past the limit of {limit} bytes")
    if not inflater.eof:
        raise _Refused(400, "bad_gzip", "body is not valid gzip: truncated stream")
    if inflater.unused_data:
        raise _Refused(400, "bad_gzip", "body is not valid gzip: trailing data after the stream")
    return out


def _parse(body: bytes) -> ReportBatch:
    try:
        return ReportBatch.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=False)
        if any(e["type"] == "json_invalid" for e in errors):
            msg = errors[0]["msg"].removeprefix("Invalid JSON: ")
            raise _Refused(400, "invalid", f"body is not valid JSON: {msg}") from None
        raise _Refused(422, "invalid", _describe(errors)) from None


def _describe(errors: list[Any]) -> str:
    parts = []
    for err in errors[:_MAX_ERRORS_SHOWN]:
        loc = err["loc"]
        path = ".".join(str(p) for p in loc) if loc else "body"
        msg = err["msg"].removeprefix("Value error, ")
        if loc == ("schema",):
            if err["type"] == "missing":
                msg = f"missing; this collector supports schema version {SCHEMA_VERSION}"
            else:
                msg = (
                    f"unsupported schema version {err.get('input')!r}; "
                    f"this collector supports version {SCHEMA_VERSION}"
                )
        parts.append(f"{path}: {msg}")
    if len(errors) > _MAX_ERRORS_SHOWN:
        parts.append(f"... and {len(errors) - _MAX_ERRORS_SHOWN} more errors")
    return "; ".join(parts)
