"""``GET /v1/alerts``: what the alert service holds (``docs/rules.md``)."""

from __future__ import annotations

from fastapi import APIRouter

from trainvitals.monitor.answers import AlertView
from trainvitals.monitor.deps import AlertsDep

__all__ = ["router"]

router = APIRouter(tags=["alerts"])


@router.get("/v1/alerts")
async def list_alerts(alerts: AlertsDep) -> list[AlertView]:
    """Alerts firing now, pending, or resolved recently."""
    return [AlertView.model_validate(a) for a in alerts.alerts()]
