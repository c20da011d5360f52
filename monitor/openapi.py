"""The collector's OpenAPI document (``GET /openapi.json``), exact where FastAPI cannot be.

``POST /v1/reports`` reads its body itself (bounded, gzip-aware: see
:mod:`~trainvitals.monitor.request_body`), so FastAPI knows nothing of it. This module
adds what the route accepts and answers:

- the request body: the wire format (``docs/wire.md``) as a JSON schema that says
  everything the collector checks within one body: metric and label name patterns,
  the names and labels it refuses (Prometheus's naming conventions among them),
  printable label values, the closed set of event
  kinds and their labels, ``sender`` and ``seq`` together. A body valid against it is
  accepted; one that is not is refused. What it cannot say: a gauge ``x`` and a counter
  ``x_total`` are refused together (they would be one family), across bodies too, and
  the series budgets (``max_series_per_run``, ``max_series``).
- every answer: 202 with ``accepted``/``duplicates``, and 400/401/408/413/415/422/503
  with ``detail``;
- the bearer tokens, when set: ``token`` on ingest, ``read_token`` on the reads.

A schema fuzzer (schemathesis, ``tests/collector/test_fuzz_and_load.py``) checks the
collector against this document.
"""

from __future__ import annotations

import sys
from functools import lru_cache
from typing import Any

from fastapi import FastAPI

from trainvitals.wire import PREFIX, RESERVED_NAMES
from trainvitals.wire.runs import MAX_RUN
from trainvitals.wire.schema import (
    EVENT_KINDS,
    HISTOGRAM_LABELS,
    LABEL_NAME_CONVENTIONS,
    MAX_DETAIL,
    MAX_EVENTS,
    MAX_LABEL_NAME,
    MAX_LABEL_VALUE,
    MAX_LABELS,
    MAX_NAME,
    MAX_RANK,
    MAX_REPORTS,
    MAX_SAMPLES,
    MAX_SEQ,
    MAX_STEP,
    MAX_TIME,
    NAME_CONVENTIONS,
    RESERVED_LABELS,
    RUN_PATTERN,
    SENDER_PATTERN,
)

__all__ = ["install", "report_batch_schema"]

_REF = "#/components/schemas/"
_DETAIL = {"type": "object", "required": ["detail"], "properties": {"detail": {"type": "string"}}}


@lru_cache(maxsize=1)
def _printable() -> str:
    """A pattern for 1+ characters that ``str.isprintable`` accepts (the label value rule),
    as one character class of literal characters (no escapes that JSON Schema's ECMA
    regexes and Python's would read differently)."""
    ranges: list[tuple[int, int]] = []
    start = None
    for code in range(sys.maxunicode + 2):
        ok = code <= sys.maxunicode and chr(code).isprintable()
        if ok and start is None:
            start = code
        elif not ok and start is not None:
            ranges.append((start, code - 1))
            start = None

    def char(code: int) -> str:
        c = chr(code)
        return "\\" + c if c in "\\]^-[" else c

    body = "".join(char(a) if a == b else f"{char(a)}-{char(b)}" for a, b in ranges)
    return f"^[{body}]+$"


def _label_value() -> dict[str, Any]:
    return {"type": "string", "minLength": 1, "maxLength": MAX_LABEL_VALUE, "pattern": _printable()}


def report_batch_schema() -> dict[str, dict[str, Any]]:
    """The JSON schemas of a ``POST /v1/reports`` body: ``ReportBatch`` and its parts."""
    sample_labels = {
        "type": "object",
        "maxProperties": MAX_LABELS,
        "propertyNames": {
            "maxLength": MAX_LABEL_NAME,
            "pattern": r"^(?:[a-zA-Z]|_[a-zA-Z0-9])[a-zA-Z0-9_]*$",
            "not": {
                "anyOf": [
                    {"enum": sorted(RESERVED_LABELS | HISTOGRAM_LABELS)},
                    *({"pattern": p} for p in LABEL_NAME_CONVENTIONS),
                ]
            },
        },
        "additionalProperties": _label_value(),
    }
    sample = {
        "type": "object",
        "description": "One value of one series: the metric name without prefix, labels, value.",
        "additionalProperties": False,
        "required": ["name", "value"],
        "properties": {
            "name": {
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_NAME,
                "pattern": "^[a-z_][a-z0-9_]*$",
                "not": {
                    "anyOf": [
                        {"pattern": f"^{PREFIX}"},
                        {"enum": sorted(RESERVED_NAMES)},
                        *({"pattern": p} for p in NAME_CONVENTIONS),
                    ]
                },
                "description": f"Without the {PREFIX!r} prefix; not a name the collector exports "
                "itself; within Prometheus's naming conventions (base units, no type or "
                "histogram suffix in the name).",
            },
            "labels": sample_labels,
            "value": {"type": "number", "description": "NaN, Infinity and -Infinity are written as such."},
        },
    }
    by_kind = [
        {
            "properties": {
                "kind": {"const": kind},
                "labels": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {name: _label_value() for name in sorted(labels)},
                },
            }
        }
        for kind, labels in sorted(EVENT_KINDS.items())
    ]
    event = {
        "type": "object",
        "description": "Something that happened once; the kinds and their labels are a closed set.",
        "additionalProperties": False,
        "required": ["kind"],
        "properties": {
            "kind": {"enum": sorted(EVENT_KINDS)},
            "detail": {"type": "string", "maxLength": MAX_DETAIL},
            "labels": {"type": "object", "maxProperties": MAX_LABELS},
        },
        "anyOf": by_kind,
    }
    report = {
        "type": "object",
        "description": "What one rank knows after one reported optimizer step. ``sender`` and "
        "``seq`` (give both or neither) make a retried report apply once.",
        "additionalProperties": False,
        "required": ["run", "step", "time"],
        "properties": {
            "run": {"type": "string", "minLength": 1, "maxLength": MAX_RUN, "pattern": RUN_PATTERN},
            "step": {"type": "integer", "minimum": 0, "maximum": MAX_STEP - 1},
            "time": {
                "type": "number",
                "minimum": 0,
                "maximum": MAX_TIME,
                "description": "Unix seconds, the reporting process's clock.",
            },
            "rank": {"type": "integer", "minimum": 0, "maximum": MAX_RANK, "default": 0},
            "samples": {"type": "array", "maxItems": MAX_SAMPLES, "items": {"$ref": _REF + "Sample"}},
            "events": {"type": "array", "maxItems": MAX_EVENTS, "items": {"$ref": _REF + "Event"}},
            "sender": {"type": ["string", "null"], "pattern": SENDER_PATTERN},
            "seq": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_SEQ},
        },
        "anyOf": [
            {"required": ["sender", "seq"], "properties": {"sender": {"type": "string"}, "seq": {"type": "integer"}}},
            {"properties": {"sender": {"type": "null"}, "seq": {"type": "null"}}},
        ],
    }
    batch = {
        "type": "object",
        "description": "The body of POST /v1/reports (docs/wire.md); gzip it with Content-Encoding: gzip.",
        "additionalProperties": False,
        "required": ["schema", "reports"],
        "properties": {
            "schema": {"const": 1},
            "reports": {"type": "array", "minItems": 1, "maxItems": MAX_REPORTS, "items": {"$ref": _REF + "Report"}},
        },
    }
    return {"ReportBatch": batch, "Report": report, "Sample": sample, "Event": event}


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
    ingest = schema["paths"]["/v1/reports"]["post"]
    ingest["requestBody"] = {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": _REF + "ReportBatch"}}},
    }
    ingest["responses"]["202"]["description"] = "Applied; duplicates: indices of reports applied before."
    ingest["responses"]["202"]["content"]["application/json"]["schema"] = {
        "type": "object",
        "required": ["accepted", "duplicates"],
        "properties": {
            "accepted": {"type": "integer", "minimum": 0},
            "duplicates": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "settings": {
                "type": "object",
                "description": "Only when a run of the batch has "
                "live settings (trainvitals configure): by run, what its hooks apply.",
            },
        },
    }
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
    ready = schema["paths"]["/readyz"]["get"]["responses"]
    ready["503"] = {
        "description": "Starting: not yet able to ingest.",
        "content": {"application/json": {"schema": {"type": "object"}}},
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
