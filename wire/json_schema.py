"""The wire body as a JSON schema (what ``/openapi.json`` says ``POST /v1/reports`` takes).

Derived from the pydantic models (:mod:`trainvitals.wire.schema`): their fields, types,
bounds, defaults and patterns come as pydantic writes them. What the models check in
:func:`~trainvitals.wire.schema.report_problem` and their validator rather than in field
types is added here in JSON Schema's terms, so a body valid against the schema is
accepted and one that is not is refused:

- metric names: the pattern, not the prefix, not a name the collector exports, within
  Prometheus's naming conventions;
- label names and values: Prometheus label names, not reserved, printable values;
- event kinds and the labels each may carry (a closed set);
- ``time`` within 0..1e11, and ``sender``/``seq`` given together;
- a coverage entry has a reason exactly when it is inactive, and names a registered
  signal (the registry as it is when the schema is first written), one entry each at most.

What a schema cannot say: a gauge ``x`` and a counter ``x_total`` are refused together
(they would be one family), across bodies too, and the collector's series budgets.
"""

from __future__ import annotations

import sys
from functools import lru_cache
from typing import Any

from trainvitals.wire.coverage import SIGNALS
from trainvitals.wire.metrics import PREFIX, RESERVED_NAMES
from trainvitals.wire.schema import (
    EVENT_KINDS,
    HISTOGRAM_LABELS,
    LABEL_NAME_CONVENTIONS,
    MAX_LABEL_NAME,
    MAX_LABEL_VALUE,
    MAX_LABELS,
    MAX_TIME,
    NAME_CONVENTIONS,
    RESERVED_LABELS,
    ReportBatch,
)

__all__ = ["LABEL_NAME_PATTERN", "METRIC_NAME_PATTERN", "printable_pattern", "report_batch_schema"]

METRIC_NAME_PATTERN = r"^[a-z_][a-z0-9_]*$"
"""A metric name on the wire (``report_problem`` checks the same)."""
LABEL_NAME_PATTERN = r"^(?:[a-zA-Z]|_[a-zA-Z0-9])[a-zA-Z0-9_]*$"
"""A label name: Prometheus's, without the ``__`` it reserves."""


@lru_cache(maxsize=1)
def printable_pattern() -> str:
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
    return {"type": "string", "minLength": 1, "maxLength": MAX_LABEL_VALUE, "pattern": printable_pattern()}


def _sample_labels() -> dict[str, Any]:
    return {
        "type": "object",
        "maxProperties": MAX_LABELS,
        "propertyNames": {
            "minLength": 1,
            "maxLength": MAX_LABEL_NAME,
            "pattern": LABEL_NAME_PATTERN,
            "not": {
                "anyOf": [
                    {"enum": sorted(RESERVED_LABELS | HISTOGRAM_LABELS)},
                    *({"pattern": p} for p in LABEL_NAME_CONVENTIONS),
                ]
            },
        },
        "additionalProperties": _label_value(),
    }


def _refine_sample(sample: dict[str, Any]) -> None:
    props = sample["properties"]
    props["name"].update(
        pattern=METRIC_NAME_PATTERN,
        description=f"Without the {PREFIX!r} prefix; not a name the collector exports itself; within "
        "Prometheus's naming conventions (base units, no type or histogram suffix in the name).",
    )
    props["name"]["not"] = {
        "anyOf": [
            {"pattern": f"^{PREFIX}"},
            {"enum": sorted(RESERVED_NAMES)},
            *({"pattern": p} for p in NAME_CONVENTIONS),
        ]
    }
    props["labels"] = {**_sample_labels(), "title": props["labels"].get("title", "Labels")}
    props["value"]["description"] = "NaN, Infinity and -Infinity are written as such."


def _refine_event(event: dict[str, Any]) -> None:
    props = event["properties"]
    props["kind"] = {**props["kind"], "enum": sorted(EVENT_KINDS)}
    props["labels"] = {"type": "object", "maxProperties": MAX_LABELS, "title": props["labels"].get("title", "Labels")}
    event["anyOf"] = [
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


def _refine_report(report: dict[str, Any]) -> None:
    report["properties"]["time"].update(
        minimum=0, maximum=MAX_TIME, description="Unix seconds, the reporting process's clock."
    )
    report["properties"]["coverage"]["maxItems"] = len(SIGNALS)
    report["anyOf"] = [
        {"required": ["sender", "seq"], "properties": {"sender": {"type": "string"}, "seq": {"type": "integer"}}},
        {"properties": {"sender": {"type": "null"}, "seq": {"type": "null"}}},
    ]


def _refine_coverage(coverage: dict[str, Any]) -> None:
    coverage["properties"]["signal"]["enum"] = list(SIGNALS)
    coverage["anyOf"] = [
        {"properties": {"active": {"const": True}, "reason": {"type": "null"}}},
        {"properties": {"active": {"const": False}, "reason": {"type": "string"}}, "required": ["reason"]},
    ]


def report_batch_schema(ref_prefix: str = "#/components/schemas/") -> dict[str, dict[str, Any]]:
    """The JSON schemas of a ``POST /v1/reports`` body by name: ``ReportBatch``, ``Report``,
    ``Sample``, ``Event`` (references between them start with ``ref_prefix``)."""
    top = ReportBatch.model_json_schema(by_alias=True, mode="validation", ref_template=ref_prefix + "{model}")
    schemas: dict[str, dict[str, Any]] = top.pop("$defs")
    top["description"] = "The body of POST /v1/reports (docs/wire.md); gzip it with Content-Encoding: gzip."
    schemas = {"ReportBatch": top, **schemas}
    _refine_sample(schemas["Sample"])
    _refine_event(schemas["Event"])
    _refine_report(schemas["Report"])
    _refine_coverage(schemas["Coverage"])
    return schemas
