"""The collector over real HTTP: uvicorn on 127.0.0.1:0, an httpx client."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import httpx
import pytest

from tests.reports import make_body, make_report, make_sample
from tests.support import metric_value, needs_tools, require_tool, running_collector
from trainvitals.monitor.settings import Settings

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {"Content-Type": "application/json", **AUTH}
GZIP = {**JSON, "Content-Encoding": "gzip"}


def encode(obj: object) -> bytes:
    return json.dumps(obj).encode()


# -- accepting ------------------------------------------------------------


def test_accepted_report_shows_in_metrics_and_runs(client):
    resp = client.post(
        "/v1/reports",
        json=make_body(
            make_report("mm-pt1", 120, [make_sample("modality_dilution_ratio", 17.0, modality="image")]),
            make_report("mm-pt1", 120, [make_sample("grad_norm", 1.5, group="all")], rank=1),
        ),
    )
    assert resp.status_code == 202
    assert resp.json() == {"accepted": 2, "duplicates": []}

    text = client.get("/metrics").text
    assert 'trainvitals_modality_dilution_ratio{modality="image",run="mm-pt1"} 17.0' in text
    assert 'trainvitals_grad_norm{group="all",rank="1",run="mm-pt1"} 1.5' in text
    assert 'trainvitals_step{run="mm-pt1"} 120.0' in text
    assert 'trainvitals_collector_reports_total{outcome="accepted"} 2.0' in text

    [run] = client.get("/v1/runs").json()
    assert run["run"] == "mm-pt1" and run["step"] == 120 and run["ranks"] == [0, 1]
    assert isinstance(run["last_report_time"], float) and run["ended"] is False


def test_run_end_event_shows_as_run_ended_until_the_run_reports_again(client):
    end = {"kind": "run_end", "detail": "Monitor.close() after 7 optimizer steps"}
    for run, events in [("closed", [end]), ("open", [])]:
        assert client.post("/v1/reports", json=make_body(make_report(run, 7, events=events))).status_code == 202
    text = client.get("/metrics").text
    assert 'trainvitals_run_ended{run="closed"} 1.0' in text
    assert 'trainvitals_run_ended{run="open"}' not in text
    assert {r["run"]: r["ended"] for r in client.get("/v1/runs").json()} == {
        "closed": True,
        "open": False,
    }

    client.post("/v1/reports", json=make_body(make_report("closed", 8)))
    assert "trainvitals_run_ended{" not in client.get("/metrics").text
    assert [r["ended"] for r in client.get("/v1/runs").json()] == [False, False]


def test_gzip_body_and_nonfinite_values_are_accepted(client):
    raw = (
        b'{"schema": 1, "reports": [{"run": "g", "step": 3, "time": 1.0, "samples": ['
        b'{"name": "grad_norm", "labels": {"group": "all"}, "value": NaN}, '
        b'{"name": "loss", "labels": {"modality": "text"}, "value": Infinity}]}]}'
    )
    resp = client.post(
        "/v1/reports",
        content=gzip.compress(raw),
        headers={"Content-Type": "application/json; charset=utf-8", "Content-Encoding": "gzip"},
    )
    assert resp.status_code == 202, resp.text
    text = client.get("/metrics").text
    assert 'trainvitals_grad_norm{group="all",run="g"} NaN' in text
    assert 'trainvitals_loss{modality="text",run="g"} +Inf' in text


def test_metrics_endpoint_is_a_plain_route_with_prometheus_content_type(client):
    resp = client.get("/metrics", follow_redirects=False)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain; version=")
    assert "# TYPE trainvitals_collector_reports_total counter" in resp.text


def test_large_metrics_response_is_gzipped_when_asked(client):
    samples = [make_sample("param_absmax", 1.0, param=f"layers.{i}.norm.weight") for i in range(2000)]
    assert client.post("/v1/reports", json=make_body(make_report("big", 1, samples))).status_code == 202
    resp = client.get("/metrics", headers={"Accept-Encoding": "gzip"})
    assert resp.headers["content-encoding"] == "gzip"
    assert resp.text.count("trainvitals_param_absmax{") == 2000
    plain = client.get("/metrics", headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in plain.headers and plain.text == resp.text


def test_health_and_readiness(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"


def test_app_state_exposes_store_and_settings(collector):
    app = collector.app
    assert app.state.store is not None and isinstance(app.state.settings, Settings)


@needs_tools("promtool")
def test_promtool_check_metrics_passes_on_the_endpoint(client):
    client.post(
        "/v1/reports",
        json=make_body(
            make_report(
                "a",
                1,
                [make_sample("loss", 1.0, modality="text"), make_sample("nonfinite_total", 2.0, what="loss")],
            ),
            make_report("a", 1, [make_sample("grad_norm", 1.0, group="all")], rank=2),
        ),
    )
    client.post("/v1/reports", content=b"nope", headers={"Content-Type": "application/json"})
    text = client.get("/metrics").content
    proc = subprocess.run([require_tool("promtool"), "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert (proc.returncode, proc.stdout + proc.stderr) == (0, b"")


# -- refusing: each bad body gets its 4xx and changes nothing -----------------

LIMITS = dict(token=TOKEN, max_body_bytes=64 * 1024, max_decompressed_bytes=256 * 1024, max_series=20)


@pytest.fixture(scope="module")
def guarded():
    """A collector with a token and small limits, holding one accepted report."""
    with running_collector(Settings(**LIMITS, state_path=None)) as collector:
        c = collector.client
        seeded = c.post("/v1/reports", content=encode(make_body(make_report("seed", 7))), headers=JSON)
        assert seeded.status_code == 202
        yield c


def _state(c: httpx.Client) -> tuple[list, str]:
    metrics = c.get("/metrics").text
    lines = [ln for ln in metrics.splitlines() if not ln.startswith("trainvitals_collector_reports_total")]
    return c.get("/v1/runs").json(), "\n".join(lines)


def _outcome(c: httpx.Client, outcome: str) -> float:
    value = metric_value(c.get("/metrics").text, "trainvitals_collector_reports_total", outcome=outcome)
    if value is None:
        raise AssertionError(f"no outcome {outcome}")
    return value


def _bomb() -> bytes:
    return gzip.compress(b"[" + b" " * (8 * 1024 * 1024) + b"]", compresslevel=9)


def _chunks(total: int):
    for _ in range(total // 4096):
        yield b" " * 4096


VALID = encode(make_body(make_report("new-run", 1)))
BAD = {
    "not_json": (b"this is not json", JSON, 400, "invalid", "not valid JSON"),
    "json_array": (b"[1, 2]", JSON, 422, "invalid", "body: Expected `object`, got `array`"),
    "schema_version": (
        encode({**make_body(make_report("new-run", 1)), "schema": 2}),
        JSON,
        422,
        "invalid",
        "supports version 1",
    ),
    "schema_missing": (
        encode({"reports": [make_report("new-run", 1)]}),
        JSON,
        422,
        "invalid",
        "schema: missing",
    ),
    "wrong_types": (
        encode(
            make_body(
                make_report(
                    "new-run",
                    1,
                    [make_sample("loss", 1.0)] * 3 + [{"name": "loss", "labels": {}, "value": "high"}],
                )
            )
        ),
        JSON,
        422,
        "invalid",
        "reports.0.samples.3.value: Expected `float`, got `str`",
    ),
    "reserved_label": (
        encode(make_body(make_report("new-run", 1, [make_sample("loss", 1.0, job="x")]))),
        JSON,
        422,
        "invalid",
        "samples.0.labels: label 'job' is reserved",
    ),
    "no_reports": (
        encode({"schema": 1, "reports": []}),
        JSON,
        422,
        "invalid",
        "reports: Expected `array` of length >= 1",
    ),
    "collector_owned_name": (
        encode(make_body(make_report("new-run", 1, [make_sample("step", 1.0)]))),
        JSON,
        422,
        "invalid",
        "produced by the collector",
    ),
    "series_limit": (
        encode(make_body(make_report("new-run", 1, [make_sample("param_max", 1.0, param=f"p{i}") for i in range(30)]))),
        JSON,
        503,
        "series_limit",
        "series limit",
    ),
    "oversized": (
        b" " * (64 * 1024 + 1),
        JSON,
        413,
        "too_large",
        "exceeds the limit of 65536 bytes",
    ),
    "oversized_chunked": (
        _chunks(80 * 1024),
        JSON,
        413,
        "too_large",
        "exceeds the limit of 65536 bytes",
    ),
    "gzip_bomb": (_bomb(), GZIP, 413, "too_large", "inflates past the limit"),
    "bad_gzip": (b"\x1f\x8b\x08\x00garbage", GZIP, 400, "bad_gzip", "not valid gzip"),
    "truncated_gzip": (gzip.compress(VALID)[:-12], GZIP, 400, "bad_gzip", "not valid gzip"),
    "plain_text": (
        VALID,
        {**AUTH, "Content-Type": "text/plain"},
        415,
        "unsupported_media",
        "send application/json",
    ),
    "no_content_type": (VALID, AUTH, 415, "unsupported_media", "send application/json"),
    "brotli": (
        VALID,
        {**JSON, "Content-Encoding": "br"},
        415,
        "unsupported_media",
        "Content-Encoding 'br'",
    ),
    "missing_token": (
        VALID,
        {"Content-Type": "application/json"},
        401,
        "unauthorized",
        "missing bearer token",
    ),
    "wrong_token": (
        VALID,
        {**JSON, "Authorization": "Bearer nope"},
        401,
        "unauthorized",
        "invalid bearer token",
    ),
    "basic_auth": (
        VALID,
        {**JSON, "Authorization": f"Basic {TOKEN}"},
        401,
        "unauthorized",
        "invalid bearer token",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_body_is_refused_and_changes_nothing(guarded, case):
    content, headers, status, outcome, detail = BAD[case]
    before = _state(guarded)
    count = _outcome(guarded, outcome)

    resp = guarded.post("/v1/reports", content=content, headers=headers)

    assert resp.status_code == status, resp.text
    assert detail in resp.json()["detail"]
    if status == 401:
        assert resp.headers["www-authenticate"].startswith("Bearer")
    assert _state(guarded) == before
    assert _outcome(guarded, outcome) == count + 1


def test_gzip_body_with_token_is_accepted(guarded):
    resp = guarded.post(
        "/v1/reports",
        content=gzip.compress(encode(make_body(make_report("seed", 8)))),
        headers=GZIP,
    )
    assert resp.status_code == 202
    assert [r["step"] for r in guarded.get("/v1/runs").json()] == [8]


def test_detail_names_the_first_bad_field(client):
    bad = [{"name": "loss", "labels": {}, "value": 1.0}] * 3 + [{"name": "loss", "labels": {}, "value": "x"}] * 25
    resp = client.post("/v1/reports", json=make_body(make_report("a", 1, bad)))
    assert resp.status_code == 422
    assert resp.json()["detail"] == "reports.0.samples.3.value: Expected `float`, got `str`"


def test_importing_the_collector_does_not_import_torch_or_the_hooks():
    code = (
        "import sys, trainvitals.monitor.app, trainvitals.monitor.cli, trainvitals.monitor.server; "
        "bad = [m for m in ('torch', 'trainvitals.hooks') if m in sys.modules]; assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
