"""One exception hierarchy (trainvitals.errors), one handler for refusals, typed answers."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
from fastapi.responses import HTMLResponse
from fastapi.routing import APIRoute

import trainvitals.errors as errors
from tests.support import running_collector
from trainvitals.wire.errors import ConfigurationError, Refused, StateError, TrainvitalsError

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("hooks", "monitor", "alerts", "wire")
# Not errors of ours to callers: a click usage message, a value the notifier loader
# turns into NotifierConfigError before it leaves the module.
PRIVATE = {"_UsageError", "_Field"}


def _exception_classes() -> list[tuple[str, str]]:
    out = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in tree.body:
                if not isinstance(node, ast.ClassDef) or node.name in PRIVATE:
                    continue
                bases = {ast.unparse(b) for b in node.bases}
                if any(b.endswith(("Error", "Exception", "Refused", "InUse", "Exceeded", "Invalid")) for b in bases):
                    module = "trainvitals." + ".".join(path.relative_to(ROOT).with_suffix("").parts)
                    out.append((module.removesuffix(".__init__"), node.name))
    return out


def test_the_public_name_is_the_wire_module():
    assert errors.TrainvitalsError is TrainvitalsError
    assert sorted(errors.__all__) == ["ConfigurationError", "Refused", "StateError", "TrainvitalsError"]
    assert issubclass(ConfigurationError, ValueError) and issubclass(StateError, OSError)


@pytest.mark.parametrize(("module", "name"), _exception_classes())
def test_every_error_of_ours_is_a_trainvitals_error(module, name):
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, TrainvitalsError), f"{module}.{name} bases {cls.__mro__}"


def test_the_scan_finds_the_errors():
    found = {name for _, name in _exception_classes()}
    assert {"EnvError", "RuleError", "IngestRefused", "BodyRefused", "StateInUse", "SettingsError"} <= found


def test_refusals_carry_their_answer():
    from trainvitals.monitor.store import RunSeriesLimitExceeded, SeriesLimitExceeded

    full = SeriesLimitExceeded("full")
    assert (full.status, full.outcome, full.headers) == (503, "series_limit", {"Retry-After": "30"})
    assert (RunSeriesLimitExceeded("x").status, RunSeriesLimitExceeded("x").outcome) == (422, "run_series_limit")
    assert isinstance(full, ValueError) and isinstance(full, Refused)


def test_routes_raise_refusals_and_return_models():
    for path in sorted((ROOT / "monitor").glob("routes_*.py")):
        text = path.read_text(encoding="utf-8")
        assert "HTTPException" not in text, f"{path.name}: raise trainvitals.errors.Refused instead"
    with running_collector() as c:
        assert c.app.exception_handlers.get(Refused) is not None
        for route in c.app.routes:
            if not isinstance(route, APIRoute) or not route.include_in_schema:
                continue
            html = isinstance(route.response_class, type) and issubclass(route.response_class, HTMLResponse)
            # JSON answers have a model; /metrics (Prometheus text) and pages (HTML) are not JSON.
            if route.path != "/metrics" and not html and route.path != "/runs/{run}":
                assert route.response_model is not None, route.path
        # One handler, one shape: a refusal from the store, from the body reader, from a route.
        for answer in (
            c.client.post("/v1/reports", content=b"{", headers={"Content-Type": "application/json"}),
            c.client.post("/v1/reports", content=b"{}", headers={"Content-Type": "text/plain"}),
            c.client.put("/v1/runs/nobody/settings", json={"every": 2}),
            c.client.post("/v1/runs/x/settings"),
        ):
            assert answer.status_code in (400, 404, 405, 415), answer.text
            assert list(answer.json()) == ["detail"] and answer.json()["detail"], answer.text
