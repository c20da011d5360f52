"""read_token: GET /metrics, /v1/*, /openapi.json and the pages (/, /runs/...) need it; the
probes do not; ingest keeps its own token. /metrics read with it is promtool-clean."""

from __future__ import annotations

import base64

import pytest

from tests.monitor.helpers import body, promtool_clean, report
from tests.support import running_collector

READ = "read-tok-8Fh2"
INGEST = "ingest-tok-3Jw6"
JSON = {"Content-Type": "application/json"}
GUARDED = ["/metrics", "/v1/runs", "/v1/alerts", "/openapi.json", "/"]


@pytest.fixture(scope="module")
def guarded():
    with running_collector(read_token=READ, token=INGEST) as c:
        yield c


@pytest.mark.parametrize("path", GUARDED)
def test_read_endpoints_need_the_read_token(guarded, path):
    get = guarded.client.get
    missing = get(path)
    challenges = missing.headers.get_list("www-authenticate")
    assert missing.status_code == 401 and challenges[0] == 'Bearer realm="trainvitals"'
    # The pages ask a browser for it too (as a Basic password); the API does not.
    assert challenges[1:] == (['Basic realm="trainvitals", charset="UTF-8"'] if path == "/" else [])
    assert "read_token" in missing.json()["detail"] and READ not in missing.text
    for wrong in (f"Bearer {INGEST}", f"Bearer {READ}x", f"Basic {READ}", READ):
        refused = get(path, headers={"Authorization": wrong})
        assert refused.status_code == 401, (wrong, refused.status_code)
        assert 'error="invalid_token"' in refused.headers["www-authenticate"]
    assert get(path, headers={"Authorization": f"Bearer {READ}"}).status_code == 200
    basic = base64.b64encode(f"anyone:{READ}".encode()).decode()
    assert get(path, headers={"Authorization": f"Basic {basic}"}).status_code == 200
    wrong = base64.b64encode(f"anyone:{INGEST}".encode()).decode()
    assert get(path, headers={"Authorization": f"Basic {wrong}"}).status_code == 401


def test_the_interactive_docs_are_off_by_default(guarded):
    """Their scripts come from a CDN: not served unless api_docs is set."""
    auth = {"Authorization": f"Bearer {READ}"}
    assert [guarded.client.get(p, headers=auth).status_code for p in ("/docs", "/redoc")] == [404, 404]
    with running_collector(api_docs=True) as c:
        assert [c.client.get(p).status_code for p in ("/docs", "/redoc")] == [200, 200]


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
def test_probes_stay_open(guarded, path):
    assert guarded.client.get(path).status_code == 200


def test_ingest_takes_its_own_token_not_the_read_token(guarded):
    post = guarded.client.post
    one = body(report("guarded", 4))
    assert post("/v1/reports", content=one, headers={**JSON, "Authorization": f"Bearer {READ}"}).status_code == 401
    ok = post("/v1/reports", content=one, headers={**JSON, "Authorization": f"Bearer {INGEST}"})
    assert ok.status_code == 202, ok.text
    metrics = guarded.client.get("/metrics", headers={"Authorization": f"Bearer {READ}"})
    assert 'trainvitals_step{run="guarded"} 4.0' in metrics.text
    assert 'trainvitals_collector_reports_total{outcome="unauthorized"} 1.0' in metrics.text
    promtool_clean(metrics.content)


def test_the_openapi_schema_is_served_with_the_read_token(guarded):
    schema = guarded.client.get("/openapi.json", headers={"Authorization": f"Bearer {READ}"}).json()
    assert "/v1/reports" in schema["paths"] and "/metrics" in schema["paths"]
