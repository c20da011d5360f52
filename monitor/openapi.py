"""The collector's OpenAPI document (``GET /openapi.json``), exact where FastAPI cannot be.

``POST /v1/reports`` reads its body itself (bounded, gzip-aware: see
:mod:`~trainvitals.monitor.request_body`), so FastAPI knows nothing of it. This module
adds what the route accepts and answers:

- the request body: the wire format (``docs/wire.md``) as a JSON schema, derived from
  the wire's pydantic models (:func:`trainvitals.wire.json_schema.report_batch_schema`),
  which says everything the collector checks within one body. A body valid against it
  is accepted; one that is not is refused. What it cannot say: a gauge ``x`` and a
  counter ``x_total`` are refused together (they would be one family), across bodies
  too, and the series budgets (``max_series_per_run``, ``max_series``).
- every answer: 202 with ``accepted``/``duplicates``, and 400/401/408/413/415/422/503
  with ``detail``;
- the bearer tokens, when set: ``token`` on ingest, ``read_token`` on the reads.

A schema fuzzer (schemathesis, ``tests/monitor/test_fuzz_and_load.py``) checks the
collector against this document.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from trainvitals.monitor.answers import Problem
from trainvitals.wire.json_schema import report_batch_schema

__all__ = ["install", "report_batch_schema"]

_REF = "#/components/schemas/"
_DETAIL = {"$ref": _REF + "Problem"}  # every error answer: monitor.answers.Problem


_INGEST_ANSWERS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "400": ("Not JSON, bad gzip, a Content-Length that is not a number.", None),
    "401": ("Missing or wrong bearer token (only with the ingest token set).", None),
    "408": ("The body did not arrive within body_timeout_seconds.", None),
    "413": ("Over max_body_bytes, or inflates past max_decompressed_bytes.", None),
    "415": ("Not application/json, or a Content-Encoding other than gzip.", None),
    "422": (
        "A field the wire format does not allow (the detail names it), a gauge/counter "
        "name clash, or a run over its series budget (max_series_per_run).",
        None,
    ),
    "503": (
        "The collector holds max_series series: retry after Retry-After seconds.",
        {"Retry-After": {"schema": {"type": "integer"}, "description": "Seconds."}},
    ),
}


def _describe(schema: dict[str, Any], *, ingest_token: bool, read_token: bool) -> None:
    components = schema.setdefault("components", {})
    components.setdefault("schemas", {}).update(report_batch_schema())
    components["schemas"].setdefault("Problem", Problem.model_json_schema())
    ingest = schema["paths"]["/v1/reports"]["post"]
    ingest["requestBody"] = {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": _REF + "ReportBatch"}}},
    }
    ingest["responses"]["202"]["description"] = "Applied; duplicates: indices of reports applied before."
    for status, (text, headers) in _INGEST_ANSWERS.items():
        if status == "401" and not ingest_token:
            continue
        answer: dict[str, Any] = {"description": text, "content": {"application/json": {"schema": _DETAIL}}}
        if headers:
            answer["headers"] = headers
        ingest["responses"][status] = answer
    schemes = components.setdefault("securitySchemes", {})
    if ingest_token:
        schemes["ingestToken"] = {"type": "http", "scheme": "bearer", "description": "token"}
        ingest["security"] = [{"ingestToken": []}]
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            if path in ("/healthz", "/readyz") or (path, method) == ("/v1/reports", "post"):
                continue
            if read_token and method == "get":
                schemes["readToken"] = {"type": "http", "scheme": "bearer", "description": "read_token"}
                operation["security"] = [{"readToken": []}]
                operation["responses"]["401"] = {
                    "description": "Missing or wrong read token.",
                    "content": {"application/json": {"schema": _DETAIL}},
                }


def install(app: FastAPI) -> None:
    """Make ``app.openapi()`` (what ``/openapi.json`` and ``/docs`` serve) the exact one."""
    original = app.openapi
    settings = app.state.settings

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            _describe(original(), ingest_token=settings.auth_required, read_token=settings.read_auth_required)
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]
