"""``GET /healthz`` (the process answers) and ``GET /readyz`` (started, able to ingest)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from trainvitals.monitor.answers import Health, Readiness
from trainvitals.monitor.deps import StoreDep

__all__ = ["router"]

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> Health:
    """The process answers."""
    return Health()


@router.get(
    "/readyz",
    response_class=JSONResponse,
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "Starting, or degraded (detail: why)."}},
)
async def readyz(request: Request, store: StoreDep) -> JSONResponse:
    """Started and able to ingest: 200 with the series count; 503 while starting, and
    ``degraded`` (with the reason) while the state file cannot be written: reports are
    still evaluated and pages still sent, but retried reports are answered 503."""
    # app.state.ready is set by the app's lifespan once the alert service runs.
    if not request.app.state.ready:
        return _answer(Readiness(status="starting"), 503)
    state = getattr(request.app.state, "state_db", None)
    problem = state.problem if state is not None else None
    if problem is not None:
        return _answer(Readiness(status="degraded", detail=problem, series=len(store)), 503)
    return _answer(Readiness(status="ready", series=len(store)))


def _answer(readiness: Readiness, status: int = 200) -> JSONResponse:
    return JSONResponse(readiness.model_dump(exclude_none=True), status)
