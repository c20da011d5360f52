"""A run that churns label values is refused alone (its own series budget, counted), and
series a rank stopped sending expire while the run lives; /metrics stays promtool-clean."""

from __future__ import annotations

from tests.monitor.helpers import body, promtool_clean, report
from tests.support import metric_series, metric_value, running_collector

JSON = {"Content-Type": "application/json"}


def params(step: int, names: range) -> list[dict]:
    return [{"name": "param_max", "labels": {"param": f"p{i}"}, "value": float(step)} for i in names]


def test_a_churning_run_is_refused_alone_and_counted():
    # 50 series per run: the per-run step and last-report series, and 48 of the run's own.
    with running_collector(max_series_per_run=50) as c:
        post = c.client.post
        assert (
            post("/v1/reports", content=body(report("churn", 1, params(1, range(40)))), headers=JSON).status_code == 202
        )
        # Label values that change every report: 40 held + 40 new > 50.
        refused = post("/v1/reports", content=body(report("churn", 2, params(2, range(40, 80)))), headers=JSON)
        assert refused.status_code == 422, refused.text
        detail = refused.json()["detail"]
        assert "run 'churn' would hold 82 series" in detail and "max_series_per_run" in detail
        assert "other runs are unaffected" in detail
        text = c.metrics()
        # Nothing of the refused batch applied: the run is still at step 1 with its 40 series.
        assert metric_value(text, "trainvitals_step", run="churn") == 1
        assert len(metric_series(text, "trainvitals_param_max")) == 40
        assert metric_value(text, "trainvitals_collector_reports_total", outcome="run_series_limit") == 1
        # Another run, with as many series, is unaffected; so is the churning run's next
        # report that keeps its label values.
        calm = post("/v1/reports", content=body(report("calm", 1, params(1, range(40)))), headers=JSON)
        assert calm.status_code == 202, calm.text
        again = post("/v1/reports", content=body(report("churn", 3, params(3, range(40)))), headers=JSON)
        assert again.status_code == 202, again.text
        text = c.metrics()
        assert metric_value(text, "trainvitals_step", run="calm") == 1
        assert metric_value(text, "trainvitals_step", run="churn") == 3
        assert metric_value(text, "trainvitals_collector_reports_total", outcome="accepted") == 3
        assert metric_value(text, "trainvitals_collector_series") == 2 * (2 + 40)
        promtool_clean(text.encode())


def test_series_a_rank_stopped_sending_expire_while_the_run_lives():
    """stale_reports=3: a series left out is gone after at most 2 x 3 of its rank's reports
    (checked every third report); one sent every time stays, and rank 1's series are
    counted by rank 1's reports only."""
    with running_collector(stale_reports=3) as c:

        def send(step: int, rank: int, names: range) -> str:
            r = c.client.post(
                "/v1/reports", content=body(report("live", step, params(step, names), rank=rank)), headers=JSON
            )
            assert r.status_code == 202, r.text
            return c.metrics()

        send(1, 1, range(5, 8))  # rank 1: three series, then silent
        text = send(1, 0, range(5))  # rank 0: p0..p4
        assert len(metric_series(text, "trainvitals_param_max")) == 8
        series_before = metric_value(text, "trainvitals_collector_series")
        for step in range(2, 8):  # rank 0 keeps only p0
            text = send(step, 0, range(1))
        kept = metric_series(text, "trainvitals_param_max")
        assert {dict(labels).get("param") for labels in kept} == {"p0", "p5", "p6", "p7"}
        assert metric_value(text, "trainvitals_param_max", run="live", param="p0") == 7
        assert metric_value(text, "trainvitals_step", run="live") == 7  # the run lives on
        assert metric_value(text, "trainvitals_collector_series") == series_before - 4
        assert c.app.state.store.stale_dropped == 4
        promtool_clean(text.encode())
