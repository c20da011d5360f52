"""``GET /v1/runs``: the live runs."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from trainvitals.monitor.deps import StoreDep

__all__ = ["router"]

router = APIRouter(tags=["runs"])


@router.get("/v1/runs")
async def runs(store: StoreDep) -> list[dict[str, Any]]:
    """Live runs: last step, last report time (collector clock, Unix seconds), ranks seen,
    and whether the latest report said the run ended."""
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
