"""``/v1/runs/{run}/settings``: live settings for a running job (``trainvitals configure``).

- ``PUT``: set them (body: :class:`~trainvitals.monitor.run_settings.SettingsRequest`);
  the job's hooks get them in the answer to their next report and apply them at the
  next step. Needs the collector's ``token`` (the one jobs send) when one is set:
  changing what a job measures is a write.
- ``GET``: what is set (a read: the ``read_token``, when one is set).
- ``DELETE``: back to the job's own settings now.

Run names may contain ``/``; the path takes them as they are (not parts that are empty,
``.`` or ``..``, which URLs do not carry as they are).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import APIRouter, Request

from trainvitals.monitor.answers import Cleared, Problem, RunSettingsAnswer, ShownSettings
from trainvitals.monitor.auth import check_ingest_token
from trainvitals.monitor.deps import RunSettingsDep, SettingsDep, StoreDep
from trainvitals.monitor.request_body import load_json, read_limited
from trainvitals.monitor.run_settings import parse_request
from trainvitals.monitor.settings import Settings
from trainvitals.monitor.state_db import StateWriteError
from trainvitals.wire.errors import Refused
from trainvitals.wire.runs import MAX_RUN, RUN_PATTERN, RUN_RULE, is_run

__all__ = ["PATH_RUN_PATTERN", "router", "settings_path"]

log = logging.getLogger(__name__)

router = APIRouter(tags=["runs"])

# A run name as this path takes it: the wire's own run names, whose "/"-separated parts
# are never empty, "." or "..", which URLs would not carry as they are.
PATH_RUN_PATTERN = RUN_PATTERN
_PATH = "/v1/runs/{run:path}/settings"
_METHODS = ("GET", "PUT", "DELETE")
_RUN_PARAMETER = {
    "parameters": [
        {
            "name": "run",
            "in": "path",
            "required": True,
            "description": "The run's name (may contain /).",
            "schema": {"type": "string", "minLength": 1, "maxLength": MAX_RUN, "pattern": PATH_RUN_PATTERN},
        }
    ]
}
_MAX_BODY = 64 * 1024  # bytes; a settings body is a few dozen


def _detail(text: str) -> dict[str, Any]:
    return {"description": text, "model": Problem}


def _answer(text: str) -> dict[str, Any]:
    return {"description": text}  # the schema: the route's response model


_BAD_RUN = _detail(f"A run name the wire refuses (it must {RUN_RULE.removeprefix('use ')}).")
_NO_ROUTE = _detail("A path no route takes (a run name with a line break).")
_WRITE_AUTH = _detail("Missing or wrong bearer token (the collector's token, as jobs send).")


def _request_body() -> dict[str, Any]:
    """The PUT body as a JSON schema (the route reads the body itself, for its errors)."""
    from trainvitals.monitor.run_settings import LIVE_FIELDS, SettingsRequest

    schema = SettingsRequest.model_json_schema()
    schema["anyOf"] = [{"required": [name]} for name in LIVE_FIELDS]  # at least one setting
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def settings_path(run: str) -> str:
    """The URL path of a run's settings."""
    return f"/v1/runs/{run}/settings"


def _run(request: Request) -> str:
    """The run of the path (read here, so a bad one is refused with this collector's
    ``detail``, and documented with its pattern in ``_RUN_PARAMETER``)."""
    run = str(request.path_params["run"])
    if not is_run(run):
        raise Refused(f"run {run!r}: {RUN_RULE}", status=422)
    return run


def _check_write_token(request: Request, settings: Settings) -> None:
    if settings.token is None:
        return
    try:
        check_ingest_token(request.headers.get("authorization"), settings.token.get_secret_value())
    except Refused as exc:
        raise Refused(
            exc.detail + " (the collector's token, as jobs send)", status=exc.status, headers=exc.headers
        ) from None


@router.put(
    _PATH,
    openapi_extra={"requestBody": _request_body(), **_RUN_PARAMETER},
    responses={
        200: _answer("Set: the job applies them from the step after its next report."),
        400: _detail("The body is not JSON, nests too deep, or the client went away before sending it."),
        401: _WRITE_AUTH,
        404: _detail("No run of this name has reported to this collector (or a path no route takes)."),
        408: _detail("The body did not arrive within body_timeout_seconds."),
        409: _detail("The run ended (its last report said so): no job is there to apply settings."),
        413: _detail("The body is over 64 KiB (declared or sent)."),
        422: _detail("A bad run name, or a setting out of range; the detail names the field."),
        503: _detail("The collector cannot write its state file now; retry later."),
    },
)
async def put_settings(
    request: Request, settings: SettingsDep, store: StoreDep, table: RunSettingsDep
) -> RunSettingsAnswer:
    """Set a run's live settings (the fields given replace the job's own until
    ``ttl_seconds`` have passed). 404 for a run that has not reported."""
    _check_write_token(request, settings)
    run = _run(request)
    # Bounded: the declared length and what arrives, within body_timeout_seconds; the
    # JSON's depth and its numbers' length (a parser recursing or an int overflowing
    # inside a validator would answer 500). BodyRefused is a Refused: answered as it says.
    data = load_json(await read_limited(request, _MAX_BODY, settings.body_timeout_seconds))
    try:
        req = parse_request(data)
    except ValueError as exc:
        raise Refused(str(exc), status=422) from None
    known = next((r for r in store.runs() if r.run == run), None)
    if known is None:
        # Names no other run: GET /v1/runs lists them, behind the read token.
        raise Refused(
            f"no run {run!r} has reported to this collector, or it expired "
            "(GET /v1/runs lists the runs; names are case-sensitive)",
            status=404,
        )
    if known.ended:
        raise Refused(
            f"run {run!r} ended at step {known.step} (its last report was Monitor.close()'s): "
            "no job is there to apply settings",
            status=409,
        )
    try:
        entry = table.set(run, req.values(), req.ttl_seconds)
    except StateWriteError as exc:
        raise Refused(f"not set: {exc}; retry later", status=503, headers={"Retry-After": "5"}) from None
    client = request.client.host if request.client else "?"
    log.info("live settings for run %r set by %s: %s for %.0f s", run, client, entry.values, req.ttl_seconds)
    return RunSettingsAnswer(run=run, settings=ShownSettings(**entry.public(entry.set_at)))


@router.get(
    _PATH,
    openapi_extra=_RUN_PARAMETER,
    responses={
        200: _answer("The run's live settings; null: the job's own."),
        404: _NO_ROUTE,
        422: _BAD_RUN,
    },
)
async def get_settings(request: Request, table: RunSettingsDep) -> RunSettingsAnswer:
    """A run's live settings; ``settings`` is null when the job runs with its own."""
    run = _run(request)
    entry = table.get(run)
    return RunSettingsAnswer(run=run, settings=ShownSettings(**entry.public(time.time())) if entry else None)


@router.delete(
    _PATH,
    openapi_extra=_RUN_PARAMETER,
    responses={
        200: _answer("Cleared: the job goes back to its own settings at its next report."),
        401: _WRITE_AUTH,
        404: _NO_ROUTE,
        422: _BAD_RUN,
    },
)
async def delete_settings(request: Request, settings: SettingsDep, table: RunSettingsDep) -> Cleared:
    """Back to the job's own settings at its next report; ``cleared`` says whether any were set."""
    _check_write_token(request, settings)
    run = _run(request)
    cleared = table.clear(run)
    if cleared:
        client = request.client.host if request.client else "?"
        log.info("live settings for run %r cleared by %s", run, client)
    return Cleared(run=run, cleared=cleared)


@router.api_route(_PATH, methods=["POST", "PATCH", "OPTIONS"], include_in_schema=False)
async def other_methods(request: Request) -> None:
    """405 naming every method the path takes (three routes share it, so Starlette's own
    405 would name only the first)."""
    raise Refused(
        f"{request.method} is not allowed here; use {', '.join(_METHODS)}",
        status=405,
        headers={"Allow": ", ".join(_METHODS)},
    )
