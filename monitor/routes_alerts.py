"""``GET /v1/alerts``: what the alert service holds (``docs/rules.md``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from trainvitals.monitor.deps import AlertsDep

__all__ = ["router"]

router = APIRouter(tags=["alerts"])


@router.get("/v1/alerts")
async def list_alerts(alerts: AlertsDep) -> list[dict[str, Any]]:
    """Alerts firing now, pending, or resolved recently."""
    return alerts.alerts()
