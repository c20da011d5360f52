"""read_token: GET /metrics, /v1/*, /docs, /redoc and /openapi.json need it; the probes do
not; ingest keeps its own token. /metrics read with it is promtool-clean."""

from __future__ import annotations

import pytest

from tests.collector.helpers import body, promtool_clean, report
from tests.support import running_collector

READ = "read-tok-8Fh2"
INGEST = "ingest-tok-3Jw6"
JSON = {"Content-Type": "application/json"}
GUARDED = ["/metrics", "/v1/runs", "/v1/alerts", "/docs", "/redoc", "/openapi.json"]


@pytest.fixture(scope="module")
def guarded():
    with running_collector(read_token=READ, token=INGEST) as c:
        yield c


@pytest.mark.parametrize("path", GUARDED)
def test_read_endpoints_need_the_read_token(guarded, path):
    get = guarded.client.get
    missing = get(path)
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == 'Bearer realm="trainvitals"'
    assert "read_token" in missing.json()["detail"] and READ not in missing.text
    for wrong in (f"Bearer {INGEST}", f"Bearer {READ}x", f"Basic {READ}", READ):
        refused = get(path, headers={"Authorization": wrong})
        assert refused.status_code == 401, (wrong, refused.status_code)
        assert 'error="invalid_token"' in refused.headers["www-authenticate"]
    assert get(path, headers={"Authorization": f"Bearer {READ}"}).status_code == 200


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
