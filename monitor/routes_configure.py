"""``/v1/runs/{run}/settings``: live settings for a running job (``trainvitals configure``).

- ``PUT``: set them (body: :class:`~trainvitals.monitor.run_settings.SettingsRequest`);
  the job's hooks get them in the answer to their next report and apply them at the
  next step. Needs the collector's ``token`` (the one jobs send) when one is set:
  changing what a job measures is a write.
- ``GET``: what is set (a read: the ``read_token``, when one is set).
- ``DELETE``: back to the job's own settings now.

Run names may contain ``/``; the path takes them as they are.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request

from trainvitals.monitor.deps import SettingsDep, StoreDep
from trainvitals.monitor.request_body import BodyRefused, check_bearer
from trainvitals.monitor.run_settings import RunSettingsTable, parse_request
from trainvitals.monitor.settings import Settings
from trainvitals.wire.schema import RUN_PATTERN

__all__ = ["RunSettingsDep", "router", "settings_path"]

log = logging.getLogger(__name__)

router = APIRouter(tags=["runs"])

_RUN_RE = re.compile(RUN_PATTERN)
_MAX_BODY = 64 * 1024  # bytes; a settings body is a few dozen


def settings_path(run: str) -> str:
    """The URL path of a run's settings."""
    return f"/v1/runs/{run}/settings"


async def get_run_settings(request: Request) -> RunSettingsTable:
    return request.app.state.run_settings


RunSettingsDep = Annotated[RunSettingsTable, Depends(get_run_settings)]


def _check_run(run: str) -> None:
    if not (1 <= len(run) <= 128 and _RUN_RE.match(run)):
        raise HTTPException(422, f"run {run!r}: use 1-128 characters from letters, digits and _ . : - /")


def _check_write_token(request: Request, settings: Settings) -> None:
    if settings.token is None:
        return
    try:
        check_bearer(request.headers.get("authorization"), settings.token.get_secret_value())
    except BodyRefused as exc:
        raise HTTPException(exc.status, exc.detail + " (the collector's token, as jobs send)",
                            exc.headers) from None


@router.put("/v1/runs/{run:path}/settings")
async def put_settings(run: str, request: Request, settings: SettingsDep, store: StoreDep,
                       table: RunSettingsDep) -> dict[str, Any]:
    """Set a run's live settings (the fields given replace the job's own until
    ``ttl_seconds`` have passed). 404 for a run that has not reported."""
    _check_write_token(request, settings)
    _check_run(run)
    body = await request.body()
    if len(body) > _MAX_BODY:
        raise HTTPException(413, f"body of {len(body)} bytes exceeds {_MAX_BODY} bytes")
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise HTTPException(400, f"body is not JSON: {exc}") from None
    try:
        req = parse_request(data)
    except ValueError as exc:
        raise HTTPException(422, str(exc)) from None
    known = [r.run for r in store.runs()]
    if run not in known:
        shown = ", ".join(known[:10]) + (f" and {len(known) - 10} more" if len(known) > 10 else "")
        raise HTTPException(404, f"no run {run!r} has reported to this collector"
                                 + (f" (runs: {shown})" if known else " (no runs yet)"))
    entry = table.set(run, req.values(), req.ttl_seconds)
    client = request.client.host if request.client else "?"
    log.info("live settings for run %r set by %s: %s for %.0f s", run, client, entry.values,
             req.ttl_seconds)
    return {"run": run, "settings": entry.public(entry.set_at)}


@router.get("/v1/runs/{run:path}/settings")
async def get_settings(run: str, table: RunSettingsDep) -> dict[str, Any]:
    """A run's live settings; ``settings`` is null when the job runs with its own."""
    _check_run(run)
    entry = table.get(run)
    return {"run": run, "settings": entry.public(time.time()) if entry is not None else None}


@router.delete("/v1/runs/{run:path}/settings")
async def delete_settings(run: str, request: Request, settings: SettingsDep,
                          table: RunSettingsDep) -> dict[str, Any]:
    """Back to the job's own settings at its next report; ``cleared`` says whether any were set."""
    _check_write_token(request, settings)
    _check_run(run)
    cleared = table.clear(run)
    if cleared:
        client = request.client.host if request.client else "?"
        log.info("live settings for run %r cleared by %s", run, client)
    return {"run": run, "settings": None, "cleared": cleared}
