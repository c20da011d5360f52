"""``GET /runbooks`` and ``GET /runbooks/{anchor}``: the alerts' runbooks as HTML pages.

Rendered from the shipped ``alerts/RUNBOOKS.md`` (:mod:`trainvitals.alerts.runbooks`),
one page per alert; notifications link to them (``runbook_url``). Open even with a
``read_token``: a link opened from a page or a phone cannot send a bearer token, and
the pages hold the shipped text only, nothing about any run.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from trainvitals.alerts.runbooks import render_index, render_page, runbooks
from trainvitals.wire.errors import Refused

__all__ = ["router"]

router = APIRouter(tags=["runbooks"])


@router.get("/runbooks", response_class=HTMLResponse)
async def runbook_index() -> HTMLResponse:
    """Every alert's runbook on one page, each under its anchor (``#paramdrift``)."""
    return HTMLResponse(render_index())


@router.get(
    "/runbooks/{anchor}", response_class=HTMLResponse, responses={404: {"description": "No runbook of that name."}}
)
async def runbook_page(anchor: str) -> HTMLResponse:
    """One alert's runbook (``/runbooks/paramdrift``; the alert's name in any case)."""
    page = render_page(anchor)
    if page is None:
        known = ", ".join(sorted(runbooks()))
        raise Refused(f"no runbook named {anchor!r}; there are: {known}", status=404)
    return HTMLResponse(page)
