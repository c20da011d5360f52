"""``POST /v1/reports``: ingest a batch of reports (format: ``docs/wire.md``)."""

from __future__ import annotations

import logging
import time

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from trainvitals.monitor.answers import IngestAnswer
from trainvitals.monitor.deps import ReportsDep, RunSettingsDep, SettingsDep, StoreDep
from trainvitals.monitor.lifetime import LifetimeDrift
from trainvitals.monitor.request_body import BodyRefused, parse_batch, read_body
from trainvitals.monitor.run_settings import RunSettingsTable
from trainvitals.monitor.state_db import StateDB
from trainvitals.monitor.store import IngestResult, SeriesStore
from trainvitals.wire.errors import Refused

__all__ = ["router"]

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
    try:
        body = await read_body(request, settings)
        state = request.app.state.state_db
        lifetime = request.app.state.lifetime
        if len(body) > _INLINE_BYTES:
            result, runs = await run_in_threadpool(_apply, store, body, state, run_settings, lifetime)
        else:
            result, runs = _apply(store, body, state, run_settings, lifetime)
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
