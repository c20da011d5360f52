"""The collector app: :func:`create_app` builds it from :class:`Settings`.

The parts live in ``app.state`` (the routes read them through
:mod:`trainvitals.monitor.deps`); one router per resource:

- ``POST /v1/reports`` (:mod:`~trainvitals.monitor.routes_ingest`, body handling in
  :mod:`~trainvitals.monitor.request_body`; taken before the routing, :class:`CollectorApp`),
- ``GET /metrics`` (:mod:`~trainvitals.monitor.routes_metrics`),
- ``GET /v1/runs`` (:mod:`~trainvitals.monitor.routes_runs`),
- ``PUT/GET/DELETE /v1/runs/{run}/settings`` (:mod:`~trainvitals.monitor.routes_configure`),
- ``GET /v1/alerts`` (:mod:`~trainvitals.monitor.routes_alerts`),
- ``GET /runbooks``, ``GET /runbooks/{anchor}`` (:mod:`~trainvitals.monitor.routes_runbooks`),
- ``GET /healthz``, ``GET /readyz`` (:mod:`~trainvitals.monitor.routes_health`),
- ``GET /``, ``GET /runs/{run}``: the report pages (:mod:`~trainvitals.monitor.routes_pages`).

Other components hook in after :func:`create_app`::

    app = create_app(settings)
    app.state.store.on_ingest(callback)                          # see every accepted batch
    app.state.exporter.register_family_source(families)          # add families to /metrics
    app.include_router(router)                                   # more endpoints

Middleware added with ``app.add_middleware`` does not see ``POST /v1/reports``: the app
(:class:`CollectorApp`) answers it before its middleware and routing.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from trainvitals.alerts import AlertService, NotifierConfigError, RuleError
from trainvitals.monitor import (
    openapi,
    routes_alerts,
    routes_configure,
    routes_health,
    routes_ingest,
    routes_metrics,
    routes_pages,
    routes_runbooks,
    routes_runs,
)
from trainvitals.monitor.answers import refused_response
from trainvitals.monitor.auth import ReadAuthMiddleware
from trainvitals.monitor.exposition import ReportCounter, StoreCollector
from trainvitals.monitor.lifetime import LifetimeDrift, judging
from trainvitals.monitor.run_settings import RunSettingsTable
from trainvitals.monitor.settings import Settings, SettingsError
from trainvitals.monitor.state_db import StateDB
from trainvitals.monitor.store import SeriesStore
from trainvitals.wire.errors import Refused

__all__ = ["CollectorApp", "create_app", "tune_gc"]

log = logging.getLogger("trainvitals.monitor")


def create_app(
    settings: Settings | None = None,
    *,
    store: SeriesStore | None = None,
    alerts: AlertService | None = None,
) -> FastAPI:
    """Build the collector app; ``settings`` default to the environment.

    ``app.state`` holds ``settings``, ``store`` (the :class:`SeriesStore`),
    ``exporter`` (the :class:`StoreCollector` that renders ``/metrics``),
    ``reports`` (the :class:`ReportCounter`), ``alerts`` (the
    :class:`AlertService`) and ``ready``. A bad rule or notifier configuration
    raises :class:`SettingsError`.
    """
    if settings is None:
        settings = Settings()
    if store is None:
        store = SeriesStore(
            ttl_seconds=settings.run_ttl_seconds,
            max_series=settings.max_series,
            max_series_per_run=settings.max_series_per_run,
            stale_reports=settings.stale_reports,
        )
    reports = ReportCounter()
    exporter = StoreCollector(store, reports)
    state: StateDB | None = None
    if settings.state_path is not None:
        try:
            state = StateDB(settings.state_path)
        except OSError as exc:
            raise SettingsError(str(exc)) from None
        for run, seen, step, ended in state.load_runs():
            store.restore_run(run, step, seen, ended)
        for run, rank, sender, floor, seqs in state.load_seqs():
            store.restore_seqs(run, rank, sender, floor, seqs)
        # Before the answer goes out: a retry after a crash or restart is still a duplicate.
        store.on_ingest(state.record_seqs)
        exporter.register_family_source(state.metric_families)
    if alerts is None:
        try:
            alerts = _alert_service(settings, state)
        except SettingsError:
            if state is not None:
                state.close()  # release the file's lock: this app will never run
            raise
    # Rules are evaluated as reports arrive (cheap, no I/O); notifiers send from their own threads.
    # They judge drift over the run's life (lifetime.judging), the store keeps it as sent.
    store.on_ingest(judging(alerts.observe_batch))
    exporter.register_family_source(alerts.metric_families)

    if state is not None:
        # The file written back after it was deleted or replaced: the engine's runs and
        # alerts are saved again in full with the next tick.
        state.on_recreated.append(alerts.resync)

    async def watch_state_file(db: StateDB) -> None:
        while True:
            await asyncio.sleep(settings.state_check_seconds)
            try:
                await run_in_threadpool(db.check_file)
                await run_in_threadpool(db.retry_writes)
            except Exception:
                log.exception("checking the state file failed")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        alerts.start()
        watcher = asyncio.create_task(watch_state_file(state)) if state is not None else None
        app.state.ready = True
        try:
            yield
        finally:
            app.state.ready = False
            if watcher is not None:
                watcher.cancel()
            await run_in_threadpool(alerts.stop)
            if state is not None:
                state.close()

    app = CollectorApp(
        title="trainvitals collector",
        summary="Ingests training-health reports and exports them to Prometheus.",
        lifespan=lifespan,
        # The interactive docs load their scripts from a CDN: off unless asked for (api_docs).
        docs_url="/docs" if settings.api_docs else None,
        redoc_url="/redoc" if settings.api_docs else None,
    )
    app.state.settings = settings
    app.state.store = store
    app.state.exporter = exporter
    app.state.reports = reports
    app.state.alerts = alerts
    app.state.ready = False
    app.state.state_db = state
    app.state.run_settings = RunSettingsTable(state)  # live settings (trainvitals configure)
    app.state.lifetime = LifetimeDrift(state)  # each run's first drift references
    for module in (
        routes_ingest,
        routes_metrics,
        routes_runs,
        routes_configure,
        routes_alerts,
        routes_runbooks,
        routes_health,
    ):
        app.include_router(module.router)
    routes_pages.install(app)  # GET / and /runs/{run}: the report pages
    if settings.read_token is not None:
        app.add_middleware(ReadAuthMiddleware, token=settings.read_token.get_secret_value())
    app.add_exception_handler(Refused, _refused)  # every refusal, from every route
    openapi.install(app)  # the ingest body and answers, which FastAPI cannot see
    return app


async def _refused(request: Request, exc: Exception) -> JSONResponse:
    """Every route's refusals: :func:`~trainvitals.monitor.answers.refused_response`."""
    assert isinstance(exc, Refused)
    return refused_response(exc)


class CollectorApp(FastAPI):
    """The collector's FastAPI app, with ``POST /v1/reports`` taken before the routing:
    :func:`~trainvitals.monitor.routes_ingest.ingest_endpoint` answers it as the route
    does (the route still documents it, and serves it under a ``root_path``), without the
    middleware, routing and dependency injection that cost about a tenth of an ingest.
    Middleware added to the app does not see those requests."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] == "/v1/reports"
            and scope["method"] == "POST"
            and not scope.get("root_path")
        ):
            await routes_ingest.ingest_endpoint(self, scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def _alert_service(settings: Settings, state: StateDB | None = None) -> AlertService:
    """The alert service the settings describe; a bad rule or notifier raises SettingsError."""
    options = dict(settings.alerts or {})
    options.setdefault("run_ttl", settings.run_ttl_seconds)
    rules = "default" if settings.rules is None else settings.rules
    if not options.get("external_url"):
        # Until serve knows the bound port (port 0): the configured address.
        from trainvitals.monitor.server import base_url

        options["external_url"] = base_url(settings.host, settings.port, tls=settings.tls_certfile is not None)
        options["external_url_default"] = True
    try:
        return AlertService.from_config(rules=rules, notifiers=settings.notifiers, persistence=state, **options)
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
