"""The wire body has one definition (the pydantic models of trainvitals.wire.schema); the
collector's msgspec structs and its OpenAPI document must say the same.

- the msgspec structs (monitor/decode.py): field by field, the same names, types,
  bounds, patterns, defaults and required fields as the pydantic models;
- /openapi.json: the request body is the schema derived from the models.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import msgspec
import pytest

from tests.support import running_collector
from trainvitals.monitor.decode import WireBatch
from trainvitals.wire import Report, ReportBatch
from trainvitals.wire.json_schema import report_batch_schema

PAIRS = {
    "ReportBatch": "WireBatch",
    "Report": "WireReport",
    "Sample": "WireSample",
    "Event": "WireEvent",
    "Coverage": "WireCoverage",
}

# Checked on both sides by report_problem (one function both decoders call), not by the
# field types: the msgspec struct leaves them to it so its error names the label.
BY_REPORT_PROBLEM = {("Sample", "labels", "additionalProperties"), ("Event", "labels", "additionalProperties")}


def _normal(node: Any, names: dict[str, str]) -> Any:
    """A schema with the spellings the two generators differ in made one: no titles or
    descriptions, references by the pydantic model's name, ``\\A...\\Z`` as ``^...$``,
    ``const`` as a one-value ``enum``, enum values sorted, empty container defaults left out, required as a set."""
    if isinstance(node, list):
        return [_normal(v, names) for v in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("title", "description"):
            continue
        if key == "$ref":
            out[key] = names.get(value.rsplit("/", 1)[-1], value.rsplit("/", 1)[-1])
        elif key == "pattern":
            out[key] = re.sub(r"\\Z$", "$", re.sub(r"^\\A", "^", value))
        elif key == "const":
            out["enum"] = [value]
        elif key == "enum":
            out[key] = sorted(value, key=repr)  # msgspec sorts a Literal's values
        elif key == "default" and value in ([], {}):
            continue
        elif key == "required":
            out[key] = sorted(value)
        else:
            out[key] = _normal(value, names)
    if "enum" in out:
        out.pop("type", None)
    return out


def _pydantic() -> dict[str, Any]:
    top = ReportBatch.model_json_schema(by_alias=True, mode="validation")
    defs = top.pop("$defs")
    return {name: _normal(s, {}) for name, s in {"ReportBatch": top, **defs}.items()}


def _msgspec() -> dict[str, Any]:
    defs = msgspec.json.schema(WireBatch)["$defs"]
    back = {v: k for k, v in PAIRS.items()}
    return {back[name]: _normal(s, back) for name, s in defs.items()}


def _without(schemas: dict[str, Any], paths: set[tuple[str, ...]]) -> dict[str, Any]:
    schemas = copy.deepcopy(schemas)
    for model, field, part in paths:
        schemas[model]["properties"][field].pop(part, None)
    return schemas


def test_the_msgspec_structs_are_the_pydantic_models():
    ours, theirs = _pydantic(), _msgspec()
    assert set(theirs) == set(ours) == set(PAIRS)
    for model, field, part in BY_REPORT_PROBLEM:
        assert theirs[model]["properties"][field][part] == {"type": "string"}  # nothing else, on purpose
    ours, theirs = _without(ours, BY_REPORT_PROBLEM), _without(theirs, BY_REPORT_PROBLEM)
    for name in PAIRS:
        assert theirs[name] == ours[name], name


def test_the_comparison_sees_a_difference():
    class Looser(msgspec.Struct, forbid_unknown_fields=True):
        run: str
        step: int
        time: float

    ours = _pydantic()["Report"]
    theirs = _normal(msgspec.json.schema(Looser)["$defs"]["Looser"], {})
    assert theirs != ours


@pytest.mark.parametrize("token", [None, "secret"])
def test_openapi_describes_the_body_the_models_define(token):
    with running_collector(token=token) as c:
        doc = c.client.get("/openapi.json").json()
    body = doc["paths"]["/v1/reports"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ReportBatch"}
    derived = report_batch_schema()
    for name, schema in derived.items():
        assert doc["components"]["schemas"][name] == schema, name
    # Derived: a field of the model is a property of the document, bounds as the model's.
    report = doc["components"]["schemas"]["Report"]
    assert set(report["properties"]) == set(Report.model_fields)
