"""``POST /v1/reports``: ingest a batch of reports (format: ``docs/wire.md``)."""

from __future__ import annotations

import logging
import time

from fastapi import APIRouter, HTTPException, Request

from trainvitals.monitor.deps import ReportsDep, SettingsDep, StoreDep
from trainvitals.monitor.request_body import BodyRefused, read_batch
from trainvitals.monitor.store import IngestRefused, SeriesLimitExceeded

__all__ = ["router"]

log = logging.getLogger(__name__)

router = APIRouter(tags=["ingest"])


@router.post("/v1/reports", status_code=202)
async def ingest_reports(
    request: Request, settings: SettingsDep, store: StoreDep, reports: ReportsDep
) -> dict[str, int]:
    """Ingest a batch of reports; ``{"accepted": n}``, or a 4xx whose detail names the problem.

    A refused body changes nothing and is counted in
    ``trainvitals_collector_reports_total{outcome}``.
    """
    try:
        batch = await read_batch(request, settings)
        try:
            n = store.ingest(batch, time.time())
        except SeriesLimitExceeded as exc:
            raise BodyRefused(422, "series_limit", str(exc)) from None
        except IngestRefused as exc:
            raise BodyRefused(422, "invalid", str(exc)) from None
    except BodyRefused as exc:
        reports.inc(exc.outcome)
        client = request.client.host if request.client else "?"
        log.info("refused a report body from %s: %d %s", client, exc.status, exc.detail)
        raise HTTPException(exc.status, exc.detail, exc.headers) from None
    reports.inc("accepted", n)
    return {"accepted": n}
