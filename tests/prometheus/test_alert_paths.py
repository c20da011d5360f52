"""The two alert paths of deploy/: the collector's engine pushing to Alertmanager,
and Prometheus evaluating the exported rules (deploy/rules) on the scraped series.

One incident sent through both into a real Alertmanager must reach the receiver as
one alert: deploy/prometheus.yml drops the job/instance labels Prometheus adds, so
both paths carry the same label set. Without that relabeling (the control) the
receiver gets two. And the exported RunSilent must stay quiet for a run that ended
with Monitor.close() (its run_end report) while it fires for one that just stopped.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.http_recorder import RecordingServer
from tests.prometheus._stack import DEPLOY, Prometheus, prometheus_config, running_prometheus
from tests.reports import make_body, make_report
from tests.support import metric_sum, needs_tools, running_alertmanager, running_collector, wait_until
from trainvitals.wire import PREFIX

pytestmark = [pytest.mark.integration, needs_tools("prometheus", "prometheus-alertmanager")]

RULES = DEPLOY / "rules" / "trainvitals.rules.yml"


def _post(
    client: httpx.Client, run: str, step: int, samples: list[dict[str, Any]], events: list[dict[str, Any]] | None = None
) -> None:
    """One wire report, as the hooks send it."""
    body = make_body(make_report(run, step, samples, events=events, time=time.time()))
    response = client.post("/v1/reports", json=body)
    assert response.status_code == 202, response.text


def _nonfinite(value: float) -> list[dict[str, Any]]:
    return [
        {"name": "nonfinite_total", "labels": {"what": "loss"}, "value": value},
        {"name": "loss", "labels": {}, "value": 2.0},
    ]


def _received_firing(am: httpx.Client) -> float:
    """Firing alerts Alertmanager has been sent, over every client and API version."""
    return metric_sum(am.get("/metrics").text, "alertmanager_alerts_received_total", status="firing")


def _prometheus_sent(prom: Prometheus) -> float:
    """Alerts Prometheus has sent to Alertmanager (its own metric)."""
    return metric_sum(prom.client.get("/metrics").text, "prometheus_notifications_sent_total")


@pytest.mark.parametrize(
    "relabel,expected", [(True, 1), (False, 2)], ids=["shipped-relabeling", "control-without-relabeling"]
)
def test_one_incident_through_both_paths_is_one_alert(tmp_path: Path, relabel: bool, expected: int) -> None:
    run = "dedup"
    with (
        RecordingServer() as receiver,
        running_alertmanager(tmp_path / "am", receiver.url, group_by=("alertname", "run")) as am_url,
        running_collector(notifiers=[{"type": "alertmanager", "url": am_url}]) as running,
        running_prometheus(
            tmp_path / "prom",
            prometheus_config(running.url, rule_files=[RULES], alertmanager_url=am_url, relabel=relabel),
        ) as prom,
        httpx.Client(base_url=am_url, timeout=10) as am,
    ):
        collector = running.client
        # The incident: a non-finite loss (NonFiniteLoss pages on the counter's increase).
        # Prometheus needs the counter at 0 in one scrape before it moves.
        _post(collector, run, 1, _nonfinite(0))
        wait_until(
            lambda: prom.query(f'{PREFIX}nonfinite_total{{run="{run}", what="loss"}} == 0'),
            60,
            "the counter at 0 scraped",
        )
        _post(collector, run, 2, _nonfinite(1))

        def firing_in_prometheus() -> list[dict[str, Any]]:
            return [a for a in prom.alerts() if a["labels"]["alertname"] == "NonFiniteLoss" and a["state"] == "firing"]

        (prom_alert,) = wait_until(firing_in_prometheus, 60, "NonFiniteLoss firing in Prometheus")
        collector_alerts = [
            a
            for a in collector.get("/v1/alerts").json()
            if a["alertname"] == "NonFiniteLoss" and a["state"] == "firing"
        ]
        assert len(collector_alerts) == 1, collector_alerts
        # Both paths have delivered: Prometheus says it sent, Alertmanager got two.
        wait_until(lambda: _prometheus_sent(prom) >= 1, 60, "Prometheus sending its alert")
        wait_until(lambda: _received_firing(am) >= 2, 60, "alerts from both paths at Alertmanager")

        stored = am.get("/api/v2/alerts", params={"filter": 'alertname="NonFiniteLoss"'}).json()
        assert len(stored) == expected, [a["labels"] for a in stored]
        want = {"alertname": "NonFiniteLoss", "severity": "page", "run": run, "what": "loss"}
        assert want in [a["labels"] for a in stored]
        if relabel:
            assert prom_alert["labels"]["job"] == "trainvitals"  # added by Prometheus, dropped on send

        def alerts_at_receiver() -> dict[str, dict[str, str]]:
            seen = {}
            for request in receiver.received():
                for alert in request.json()["alerts"]:
                    if alert["labels"]["alertname"] == "NonFiniteLoss":
                        seen[alert["fingerprint"]] = alert["labels"]
            return seen

        seen = wait_until(
            lambda: len(alerts_at_receiver()) >= expected and alerts_at_receiver(),
            60,
            f"{expected} NonFiniteLoss alert(s) at the webhook",
        )
        assert len(seen) == expected, list(seen.values())
        assert want in seen.values()


def _short_silence_rules(folder: Path, seconds: int) -> Path:
    """The shipped rule file with RunSilent's silence shortened to ``seconds``."""
    data = yaml.safe_load(RULES.read_text())
    (silent,) = [r for g in data["groups"] for r in g["rules"] if r.get("alert") == "RunSilent"]
    expr, n = re.subn(r"(last_report_timestamp_seconds\s*>\s*)\d+(?:\.\d+)?", rf"\g<1>{seconds}", silent["expr"])
    assert n == 1, f"RunSilent's silence not found in {silent['expr']!r}"
    silent["expr"] = expr
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "short-silence.rules.yml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _silent_runs(prom: Prometheus) -> dict[str, str]:
    return {a["labels"]["run"]: a["state"] for a in prom.alerts() if a["labels"]["alertname"] == "RunSilent"}


def test_exported_run_silent_spares_a_run_that_ended_cleanly(tmp_path: Path) -> None:
    rules = _short_silence_rules(tmp_path / "rules", 2)
    with (
        running_collector() as running,
        running_prometheus(tmp_path / "prom", prometheus_config(running.url, rule_files=[rules])) as prom,
    ):
        collector = running.client
        # The finished run reports first, so it is at least as silent as the crashed one.
        _post(collector, "finished", 1, [{"name": "loss", "labels": {}, "value": 2.0}])
        _post(
            collector,
            "finished",
            1,
            [],  # what Monitor.close() sends last
            [{"kind": "run_end", "detail": "Monitor.close() after 1 optimizer steps", "labels": {}}],
        )
        _post(collector, "crashed", 1, [{"name": "loss", "labels": {}, "value": 2.0}])
        wait_until(
            lambda: _silent_runs(prom).get("crashed") == "firing",
            60,
            "RunSilent firing for the run that stopped without run_end",
        )
        exported = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
        silent_exprs = [r["expr"] for r in exported if r.get("alert") == "RunSilent"]
        assert "finished" not in _silent_runs(prom), (
            f"the exported RunSilent fires for a run that ended with run_end: {silent_exprs}"
        )
