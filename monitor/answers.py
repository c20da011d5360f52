"""The collector's answers, as response models: what each route returns, and what
``/openapi.json`` says it returns (FastAPI derives the schemas from these).

Errors are one shape for every route, :class:`Problem` (``{"detail": "..."}``), answered
by one exception handler from a :class:`trainvitals.errors.Refused`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse

from trainvitals.wire.errors import Refused

__all__ = [
    "AlertView",
    "Cleared",
    "Health",
    "IngestAnswer",
    "Problem",
    "Readiness",
    "RunSettingsAnswer",
    "RunView",
    "ShownSettings",
    "refused_response",
]


class Problem(BaseModel):
    """Every error answer: what was refused and why."""

    detail: str


def refused_response(exc: Refused) -> JSONResponse:
    """The one answer to a :class:`~trainvitals.errors.Refused`: ``{"detail": ...}``, its
    status and headers (the shape FastAPI gives its own errors)."""
    return JSONResponse(Problem(detail=exc.detail).model_dump(), exc.status, headers=exc.headers)


class IngestAnswer(BaseModel):
    """``POST /v1/reports``, 202: the reports applied."""

    accepted: int = Field(ge=0, description="Reports applied by this request.")
    duplicates: list[int] = Field(description="Indices of reports applied before (a retry), skipped.")
    settings: dict[str, dict[str, Any]] | None = Field(
        None,
        description="Only when a run of the batch has live settings (trainvitals configure): "
        "by run, what its hooks apply (the fields set and expires_in, seconds).",
    )


class ShownSettings(BaseModel):
    """A run's live settings as shown: the fields set (every, signals, per_param,
    probe_every; only those given), when they were set and until when."""

    model_config = ConfigDict(extra="allow")

    set_at: float = Field(description="Unix seconds.")
    expires_at: float = Field(description="Unix seconds.")
    expires_in: float = Field(description="Seconds left.")


class RunSettingsAnswer(BaseModel):
    """A run's live settings; ``settings`` null: the job runs with its own."""

    run: str
    settings: ShownSettings | None


class Cleared(BaseModel):
    """``DELETE``: back to the job's own settings; ``cleared``: whether any were set."""

    run: str
    settings: None = None
    cleared: bool


class RunView(BaseModel):
    """One live run (``GET /v1/runs``)."""

    run: str
    step: int = Field(description="The last step reported.")
    last_report_time: float = Field(description="When the last report arrived (collector clock, Unix seconds).")
    ranks: list[int] = Field(description="The ranks seen.")
    ended: bool = Field(description="The latest report said the run ended (Monitor.close()).")
    settings: ShownSettings | None = Field(description="Live settings set by trainvitals configure; null: none.")


class AlertView(BaseModel):
    """One alert (``GET /v1/alerts``): firing, pending or resolved recently."""

    model_config = ConfigDict(extra="allow")  # a newer service may show more

    alertname: str
    labels: dict[str, str]
    state: Literal["firing", "pending", "resolved"]
    value: float | None = Field(description="The value that decided the state; null when not finite.")
    since: float | None
    severity: str
    summary: str
    description: str
    runbook: str | None
    step: int | None
    fired_at: float | None
    resolved_at: float | None
    fired_value: float | None = Field(None, description="The value when it fired; null when not finite.")
    since_time: str | None = Field(None, description="``since`` as RFC 3339 UTC.")
    fired_at_time: str | None = Field(None, description="``fired_at`` as RFC 3339 UTC.")
    resolved_at_time: str | None = Field(None, description="``resolved_at`` as RFC 3339 UTC.")
    runbook_url: str = Field("", description="The runbook link notifications carry (the collector's page).")
    generator_url: str = Field("", description="The run's page, the notifications' generatorURL.")
    resolved_reason: str | None = Field(
        None, description="Why it resolved when its value did not clear it (the run ended); null otherwise."
    )


class Health(BaseModel):
    """``GET /healthz``: the process answers."""

    status: Literal["ok"] = "ok"


class Readiness(BaseModel):
    """``GET /readyz``: ``ready`` (200), or ``starting``/``degraded`` (503, ``detail`` the reason)."""

    status: Literal["ready", "starting", "degraded"]
    series: int | None = None
    detail: str | None = None
