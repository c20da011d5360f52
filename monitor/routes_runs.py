"""``GET /v1/runs``: the live runs."""

from __future__ import annotations

import time

from fastapi import APIRouter

from trainvitals.monitor.answers import RunView, ShownSettings
from trainvitals.monitor.deps import RunSettingsDep, StoreDep

__all__ = ["router"]

router = APIRouter(tags=["runs"])


@router.get("/v1/runs")
async def runs(store: StoreDep, run_settings: RunSettingsDep) -> list[RunView]:
    """Live runs: last step, last report time (collector clock, Unix seconds), ranks seen,
    whether the latest report said the run ended, and the live settings set for it by
    ``trainvitals configure`` (null: the job's own)."""
    now = time.time()
    out = []
    for r in store.runs(now):
        live = run_settings.get(r.run)
        out.append(
            RunView(
                run=r.run,
                step=r.step,
                last_report_time=r.last_report_time,
                ranks=list(r.ranks),
                ended=r.ended,
                settings=ShownSettings(**live.public(now)) if live is not None else None,
            )
        )
    return out
