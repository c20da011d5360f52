"""``POST /v1/reports``: ingest a batch of reports (format: ``docs/wire.md``).

Two ways in, one ingest (:func:`ingest`): :func:`ingest_endpoint`, a plain ASGI
endpoint the collector app calls for ``POST /v1/reports`` before FastAPI's routing
(:class:`~trainvitals.monitor.app.CollectorApp`: routing, dependency injection and
response validation cost about a tenth of the ingest), and the FastAPI route
:func:`ingest_reports`, which documents the route in ``/openapi.json`` and serves the
requests the endpoint does not take (an app mounted under a ``root_path``). Both read
the body with the same limits, answer with the same bytes (the refusals through
:func:`~trainvitals.monitor.answers.refused_response`, the app's one handler) and count
the same outcomes.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import State
from starlette.responses import PlainTextResponse, Response
from starlette.types import Receive, Scope, Send

from trainvitals.monitor.answers import IngestAnswer, refused_response
from trainvitals.monitor.auth import check_ingest_token
from trainvitals.monitor.deps import ReportsDep, RunSettingsDep, SettingsDep, StoreDep
from trainvitals.monitor.lifetime import LifetimeDrift
from trainvitals.monitor.request_body import BodyRefused, parse_batch, read_body
from trainvitals.monitor.run_settings import RunSettingsTable
from trainvitals.monitor.state_db import StateDB
from trainvitals.monitor.store import IngestResult, SeriesStore
from trainvitals.wire.errors import Refused

__all__ = ["ingest", "ingest_endpoint", "router"]

log = logging.getLogger(__name__)

router = APIRouter(tags=["ingest"])

# Bodies above this (JSON bytes) are decoded and applied on a worker thread: a
# 10^6-sample body takes about a second of CPU, which must not stall the event
# loop (other requests, /metrics, /healthz). Smaller ones are cheaper inline.
_INLINE_BYTES = 256 * 1024
# Seconds a client should wait before retrying when the state file cannot be written
# (the disk may be freed any moment; a full collector: store.FULL_RETRY_AFTER).
_STATE_RETRY_AFTER = 5


@router.post("/v1/reports", status_code=202, response_model_exclude_unset=True)
async def ingest_reports(
    request: Request,
    settings: SettingsDep,
    store: StoreDep,
    reports: ReportsDep,
    run_settings: RunSettingsDep,
) -> IngestAnswer:
    """Ingest a batch of reports: ``{"accepted": n, "duplicates": [i, ...]}``, or a 4xx/503
    whose detail names the problem. ``settings`` (only when there are any): the live
    settings of the batch's runs, by run, for the hooks to apply (docs/wire.md).

    ``duplicates`` are the indices of reports applied before (a retry: same run,
    rank, ``sender`` and ``seq``), skipped this time. A refused body changes
    nothing and is counted in ``trainvitals_collector_reports_total{outcome}``.
    """
    return await ingest(request, request.app.state)


async def ingest_endpoint(app: Any, scope: Scope, receive: Receive, send: Send) -> None:
    """``POST /v1/reports`` as a plain ASGI endpoint of ``app`` (the collector app): the
    answers of :func:`ingest_reports` as FastAPI gives them, byte for byte (an unexpected
    error: 500 ``Internal Server Error``, raised on to the server, as Starlette does)."""
    started = False

    async def sending(message: Any) -> None:
        nonlocal started
        started = True
        await send(message)

    try:
        try:
            answer = await ingest(Request(scope, receive), app.state)
        except Refused as exc:
            response: Response = refused_response(exc)
        else:
            # What FastAPI sends for the route's response model (exclude_unset, by alias).
            response = Response(
                answer.model_dump_json(exclude_unset=True, by_alias=True), 202, None, "application/json"
            )
        await response(scope, receive, sending)
    except Exception:
        if not started:
            await PlainTextResponse("Internal Server Error", status_code=500)(scope, receive, send)
        raise


async def ingest(request: Request, state: State) -> IngestAnswer:
    """Read, decode and apply the request's body; the answer, or :class:`Refused` (counted
    in ``trainvitals_collector_reports_total{outcome}`` and logged)."""
    reports = state.reports
    run_settings = state.run_settings
    try:
        token = state.settings.token
        check_ingest_token(request.headers.get("authorization"), None if token is None else token.get_secret_value())
        body = await read_body(request, state.settings)
        if len(body) > _INLINE_BYTES:
            result, runs = await run_in_threadpool(
                _apply, state.store, body, state.state_db, run_settings, state.lifetime
            )
        else:
            result, runs = _apply(state.store, body, state.state_db, run_settings, state.lifetime)
    except Refused as exc:  # answered by the app's handler; counted and logged here
        reports.inc(exc.outcome)
        client = request.client.host if request.client else "?"
        log.info("refused a report body from %s: %d %s", client, exc.status, exc.detail)
        raise
    reports.inc("accepted", result.accepted)
    if result.duplicates:
        reports.inc("duplicate", len(result.duplicates))
    answer = IngestAnswer(accepted=result.accepted, duplicates=list(result.duplicates))
    live = run_settings.answer(runs)
    if live:  # only then: the key is left out otherwise (exclude_unset)
        answer.settings = live
    return answer


def _apply(
    store: SeriesStore,
    body: bytes,
    state: StateDB | None = None,
    run_settings: RunSettingsTable | None = None,
    lifetime: LifetimeDrift | None = None,
) -> tuple[IngestResult, set[str]]:
    """Apply the body; also the runs it carries (their live settings go in the answer).

    With a state file, a body whose reports carry ``seq`` is acknowledged only once the
    collector's memory of them is written: until then 503 (the job keeps them and
    retries; the retry is recognised as a duplicate, so nothing is applied twice, and
    its alerts were evaluated and paged at the first try)."""
    batch = parse_batch(body)
    now = time.time()
    if lifetime is not None:  # a resumed run's drift judged since its first reference
        lifetime.apply(batch, now)
    # IngestRefused and its subclasses carry their status (a full collector: 503 with
    # Retry-After, the client keeps the reports and retries).
    result = store.apply(batch, now)
    if run_settings is not None:
        for run in result.new_runs:  # live settings die with their run
            run_settings.forget(run, set_before=now)
    if state is not None and any(r.seq is not None for r in batch.reports) and not state.seqs_saved():
        raise BodyRefused(
            503,
            "state_unwritable",
            f"the collector cannot write its state file ({state.problem}); retry later",
            {"Retry-After": str(_STATE_RETRY_AFTER)},
        )
    return result, {r.run for r in batch.reports}
