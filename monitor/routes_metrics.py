"""``GET /metrics``: the Prometheus text exposition (:meth:`StoreCollector.render`)."""

from __future__ import annotations

import gzip

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from trainvitals.monitor.deps import ExporterDep
from trainvitals.monitor.exposition import StoreCollector

__all__ = ["router"]

_GZIP_MIN_BYTES = 64 * 1024  # gzip responses only when worth the CPU

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response)
async def metrics(request: Request, exporter: ExporterDep) -> Response:
    """Prometheus text exposition, gzipped when asked for and large."""
    gz = "gzip" in request.headers.get("accept-encoding", "")
    # In the thread pool: a large store takes long enough to render to stall ingest.
    data, encoded = await run_in_threadpool(_render, exporter, gz)
    headers = {"Content-Encoding": "gzip", "Vary": "Accept-Encoding"} if encoded else None
    return Response(data, media_type=CONTENT_TYPE_LATEST, headers=headers)


def _render(exporter: StoreCollector, gz: bool) -> tuple[bytes, bool]:
    data = exporter.render()
    if gz and len(data) >= _GZIP_MIN_BYTES:
        return gzip.compress(data, compresslevel=1), True
    return data, False
