"""``GET /v1/alerts``: what the alert service holds (``docs/rules.md``)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query

from trainvitals.monitor.answers import AlertView
from trainvitals.monitor.deps import AlertsDep

__all__ = ["router"]

router = APIRouter(tags=["alerts"])

State = Literal["firing", "pending", "resolved"]


@router.get("/v1/alerts")
async def list_alerts(
    alerts: AlertsDep,
    run: Annotated[str | None, Query(description="Only this run's alerts.")] = None,
    state: Annotated[
        list[State] | None, Query(description="Only alerts in these states (repeat: state=firing&state=pending).")
    ] = None,
) -> list[AlertView]:
    """Alerts firing now, pending, or resolved recently; times as Unix seconds and RFC 3339."""
    return [AlertView.model_validate(a) for a in alerts.alerts(run=run, states=state)]
