"""Notifiers and the dispatcher against local HTTP servers that record what they get."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import yaml
from prometheus_client import CollectorRegistry

from tests.http_recorder import RecordingServer
from tests.reports import wire_report
from tests.support import dead_url, wait_until
from trainvitals.alerts.dispatch import Dispatcher, RetryPolicy
from trainvitals.alerts.engine import Engine
from trainvitals.alerts.loading import parse_rules
from trainvitals.alerts.notifiers.base import Notification, Notifier, dedup_key
from trainvitals.alerts.notifiers.config import (
    NotifierConfigError,
    build_notifiers,
    parse_notifier_configs,
)
from trainvitals.alerts.service import AlertService
from trainvitals.wire import ReportBatch

FAST = RetryPolicy(attempts=3, initial=0.01, maximum=0.05)

RULES = parse_rules(
    yaml.safe_load("""
- alert: GradientDilution
  metric: modality_dilution_ratio
  above: 5
  clear: 3
  severity: page
  summary: "{modality} gets {value:.1f}x less gradient in run {run}"
  description: "diluted"
  runbook: "RUNBOOKS.md#gradientdilution"
""")
)


def fire(
    svc: AlertService, step: int, value: float, modality: str = "image", run: str = "r1", now: float = 1_764_400_000.0
):
    r = wire_report(step, [("modality_dilution_ratio", {"modality": modality}, value)], run=run)
    return svc.observe(r, now=now)


@contextmanager
def delivering(svc: AlertService, timeout: float = 5.0) -> Iterator[AlertService]:
    """``svc``'s notifier workers, without its ticker: these tests observe and tick at
    times they choose (``fire(now=...)``, ``svc.tick(now)``). The ticker ticks on the real
    clock, a year after those times, so each of its ticks would expire the tests' runs
    and send their resolves: more requests the longer a test runs (a loaded machine)."""
    svc.dispatcher.start()
    try:
        yield svc
    finally:
        svc.stop(timeout)


def service(configs, *, max_alerts_per_rule: int = 1000, **kw) -> AlertService:
    """A service whose rules may open many alerts per run (these tests open hundreds)."""
    kw.setdefault("retry", FAST)
    return AlertService(Engine(RULES, max_alerts_per_rule=max_alerts_per_rule), build_notifiers(configs), **kw)


def test_alertmanager_payload_resend_and_resolve():
    with RecordingServer() as server:
        svc = service(
            [{"type": "alertmanager", "url": server.url + "/"}],
            resend_interval=60,
            external_url="http://collector:9477/",
            runbook_base_url="https://example.org/runbooks",
        )
        with delivering(svc):
            t0 = 1_764_400_000.0
            fire(svc, 0, 17.0, now=t0)
            wait_until(lambda: server.count() == 1)
            svc.tick(t0 + 30)  # not yet due
            svc.tick(t0 + 60)  # re-sent with endsAt ahead
            wait_until(lambda: server.count() == 2)
            fire(svc, 10, 1.0, now=t0 + 70)
            wait_until(lambda: server.count() == 3)
        first, repeat, resolved = server.bodies()
        assert {r.path for r in server.received()} == {"/api/v2/alerts"}
        (a,) = first
        assert a == {
            "labels": {"alertname": "GradientDilution", "severity": "page", "run": "r1", "modality": "image"},
            "annotations": {
                "summary": "image gets 17.0x less gradient in run r1",
                "description": "diluted",
                "runbook_url": "https://example.org/runbooks/RUNBOOKS.md#gradientdilution",
            },
            "startsAt": "2025-11-29T07:06:40.000Z",
            "endsAt": "2025-11-29T07:10:40.000Z",  # now + 4 * resend
            "generatorURL": "http://collector:9477/runs/r1",
        }
        assert repeat[0]["labels"] == a["labels"] and repeat[0]["endsAt"] == "2025-11-29T07:11:40.000Z"
        assert resolved[0]["labels"] == a["labels"]
        assert resolved[0]["endsAt"] == "2025-11-29T07:07:50.000Z"  # endsAt = resolve time
        assert svc.stats()["alertmanager"] == {"sent": 3, "failed": 0, "dropped": 0, "retries": 0, "queued": 0}


def test_server_error_is_retried_and_the_alert_arrives_once():
    with RecordingServer(responses=[500, 503]) as server:
        svc = service([{"type": "webhook", "url": server.url + "/hook"}])
        with delivering(svc):
            fire(svc, 0, 17.0)
            wait_until(lambda: svc.stats()["webhook"]["sent"] == 1)
        assert server.count() == 3  # 500, 503, then 200
        bodies = server.bodies()
        assert bodies[0] == bodies[2]
        assert svc.stats()["webhook"] == {"sent": 1, "failed": 0, "dropped": 0, "retries": 2, "queued": 0}


def _observe_many(svc: AlertService, n: int) -> int:
    """n reports, each making a new series fire; returns the transitions observed."""
    count = 0
    for i in range(n):
        count += len(fire(svc, i, 17.0, modality=f"m{i}"))
    return count


@pytest.mark.parametrize("receiver", ["hangs", "refuses"])
def test_dead_receiver_does_not_slow_observe_and_counts_failures(receiver):
    """observe() returns as many transitions with a dead receiver as with a healthy one."""
    n = 200
    with RecordingServer() as healthy:
        svc = service([{"type": "webhook", "url": healthy.url}], queue_size=20)
        with delivering(svc):
            baseline = _observe_many(svc, n)
    dead = RecordingServer(hang=True)
    url = dead.url if receiver == "hangs" else dead_url()
    try:
        svc = service(
            [{"type": "webhook", "url": url, "timeout": 0.2}],
            queue_size=20,
            retry=RetryPolicy(attempts=2, initial=0.01, maximum=0.02),
        )
        with delivering(svc, timeout=1.0):
            done = []
            worker = threading.Thread(target=lambda: done.append(_observe_many(svc, n)))
            worker.start()
            worker.join(60)
            assert done == [baseline] == [n]  # every observe returned, none lost
            wait_until(lambda: svc.stats()["webhook"]["failed"] >= 1)
            stats = svc.stats()["webhook"]
            assert stats["sent"] == 0 and stats["retries"] >= 1
            assert stats["dropped"] > 0  # the queue (20) filled while the receiver was dead
        # stop() gave up on the send in flight by closing its client; its worker counts
        # that batch as failed once the closed client fails it: wait for that, not a margin.
        settled = wait_until(lambda: (st := svc.stats()["webhook"])["failed"] + st["dropped"] >= n and st, 60)
        assert settled["failed"] + settled["dropped"] == n and settled["queued"] == 0, settled
    finally:
        dead.close()


def test_pagerduty_trigger_resolve_and_dedup_key(monkeypatch, tmp_path):
    monkeypatch.setenv("PD_KEY", "R0UT1NGKEY")
    with RecordingServer(default=202, body=b'{"status":"success"}') as server:
        svc = service([{"type": "pagerduty", "url": server.url, "routing_key_env": "PD_KEY"}])
        with delivering(svc):
            fire(svc, 0, 17.0, run="mm-pt1")
            fire(svc, 10, 1.0, run="mm-pt1")
            wait_until(lambda: server.count() == 2)
        trigger, resolve = server.bodies()
        assert {r.path for r in server.received()} == {"/v2/enqueue"}
        key = 'GradientDilution{modality="image",run="mm-pt1"}'
        assert trigger["routing_key"] == "R0UT1NGKEY" and trigger["event_action"] == "trigger"
        assert trigger["dedup_key"] == key
        payload = trigger["payload"]
        assert payload["severity"] == "critical"  # page -> critical
        assert payload["summary"] == "[GradientDilution] image gets 17.0x less gradient in run mm-pt1"
        assert payload["source"] == "mm-pt1" and payload["class"] == "GradientDilution"
        assert payload["custom_details"]["modality"] == "image" and payload["custom_details"]["value"] == 17.0
        assert payload["timestamp"].endswith("Z")
        assert resolve == {"routing_key": "R0UT1NGKEY", "dedup_key": key, "event_action": "resolve"}

    # The key file works too, and a second collector derives the same dedup_key.
    keyfile = tmp_path / "pd.key"
    keyfile.write_text("FILEKEY\n")
    with RecordingServer(default=202) as server:
        svc = service([{"type": "pagerduty", "url": server.url, "routing_key_file": str(keyfile)}])
        with delivering(svc):
            fire(svc, 0, 17.0, run="mm-pt1")
            wait_until(lambda: server.count() == 1)
        (body,) = server.bodies()
        assert body["routing_key"] == "FILEKEY" and body["dedup_key"] == key


@pytest.mark.parametrize(
    ("status", "requests", "outcome"),
    [
        (400, 1, "failed"),  # a bad event: never retried
        (403, 1, "failed"),
        (429, 2, "sent"),  # rate limited: retried
        (502, 2, "sent"),
    ],
)
def test_pagerduty_retries_only_429_and_5xx(status, requests, outcome):
    with RecordingServer(responses=[status], default=202) as server:
        svc = service([{"type": "pagerduty", "url": server.url, "routing_key": "k"}])
        with delivering(svc):
            fire(svc, 0, 17.0)
            wait_until(lambda: svc.stats()["pagerduty"][outcome] == 1)
        assert server.count() == requests
        assert svc.stats()["pagerduty"]["retries"] == requests - 1


def test_slack_message_shape_and_rate_limit(monkeypatch):
    with RecordingServer(responses=[(429, b"rate_limited", {"Retry-After": "0"})]) as server:
        monkeypatch.setenv("SLACK_URL", server.url + "/services/T000/B000/XXXX")
        svc = service([{"type": "slack", "webhook_url_env": "SLACK_URL"}], runbook_base_url="https://example.org/rb")
        with delivering(svc):
            fire(svc, 0, 17.0)
            fire(svc, 10, 1.0)
            wait_until(lambda: svc.stats()["slack"]["sent"] == 2)
        first, retried, resolved = server.bodies()
        assert first == retried
        assert first["text"] == ":rotating_light: [FIRING] GradientDilution: image gets 17.0x less gradient in run r1"
        assert [b["type"] for b in first["blocks"]] == ["section", "section", "context"]
        context = first["blocks"][-1]["elements"][0]["text"]
        assert (
            "`modality=image`" in context and "<https://example.org/rb/RUNBOOKS.md#gradientdilution|runbook>" in context
        )
        assert resolved["text"].startswith(":white_check_mark: [RESOLVED] GradientDilution")
        assert svc.stats()["slack"]["retries"] == 1


def test_webhook_headers_and_body(monkeypatch):
    monkeypatch.setenv("HOOK_TOKEN", "Bearer t0ken")
    with RecordingServer() as server:
        svc = service(
            [
                {
                    "type": "webhook",
                    "url": server.url,
                    "headers": {"X-Team": "ml"},
                    "headers_env": {"Authorization": "HOOK_TOKEN"},
                }
            ]
        )
        with delivering(svc):
            fire(svc, 0, 17.0)
            wait_until(lambda: server.count() == 1)
        req = server.received()[0]
        assert req.headers["Authorization"] == "Bearer t0ken" and req.headers["X-Team"] == "ml"
        body = req.json()
        assert body["status"] == "firing" and body["version"] == "1"
        (a,) = body["alerts"]
        assert a["fingerprint"] == 'GradientDilution{modality="image",run="r1"}' and a["value"] == 17.0


def test_secrets_never_in_repr_or_logs(caplog, monkeypatch):
    with RecordingServer() as server:
        secret_url = server.url + "/services/T000/B000/SECRETPART"
        monkeypatch.setenv("SLACK_URL", secret_url)
        configs = [
            {"type": "slack", "webhook_url_env": "SLACK_URL"},
            {"type": "pagerduty", "routing_key": "SECRETKEY", "url": dead_url()},
            {"type": "webhook", "url": server.url, "headers": {"Authorization": "SECRETTOKEN"}},
        ]
        parsed = parse_notifier_configs(configs)
        svc = service(configs, retry=RetryPolicy(attempts=2, initial=0.01, maximum=0.01))
        with caplog.at_level(logging.DEBUG):
            with delivering(svc):
                fire(svc, 0, 17.0)
                wait_until(lambda: svc.stats()["pagerduty"]["failed"] == 1 and server.count() == 2)
    texts = [caplog.text, repr(parsed), repr(svc.dispatcher.notifiers), str(svc.stats())]
    for secret in ("SECRETPART", "SECRETKEY", "SECRETTOKEN"):
        assert all(secret not in t for t in texts), secret
    assert "notifier pagerduty: gave up" in caplog.text
    assert "HTTP Request: POST" in caplog.text  # httpx did log the request, redacted


def test_config_errors_name_the_entry_and_field(monkeypatch):
    monkeypatch.delenv("NOPE", raising=False)
    cases = [
        (
            [{"type": "pagerduty", "routing_key_env": "NOPE"}],
            "notifiers[0] (pagerduty): field 'routing_key_env': environment variable NOPE is not set",
        ),
        (
            [{"type": "alertmanager", "url": "http://a"}, {"type": "alertmanager", "url": "am:9093"}],
            "notifiers[1] (alertmanager): field 'url': must be an http:// or https:// URL",
        ),
        ([{"type": "pagerduty"}], "notifiers[0] (pagerduty): give exactly one of"),
        ([{"type": "email"}], "notifiers[0] (email): field 'type': must be one of"),
        (
            [{"type": "slack", "webhook_url": "x", "colour": "red"}],
            "notifiers[0] (slack): field 'colour': Extra inputs",
        ),
        (
            [{"type": "webhook", "url": "http://a", "name": "x"}, {"type": "webhook", "url": "http://b", "name": "x"}],
            "notifiers[1] (webhook): field 'name': duplicate name 'x'",
        ),
    ]
    for configs, message in cases:
        with pytest.raises(NotifierConfigError) as info:
            build_notifiers(configs)
        assert str(info.value).startswith(message), str(info.value)
    names = [
        n.name
        for n in build_notifiers(
            [{"type": "alertmanager", "url": "http://a"}, {"type": "alertmanager", "url": "http://b"}]
        )
    ]
    assert names == ["alertmanager", "alertmanager-2"]


class _Recorder(Notifier):
    type = "recorder"

    def __init__(self, name: str, repeats: bool = False) -> None:
        super().__init__(name)
        self.wants_repeats = repeats
        self.got: list[Notification] = []

    def send(self, batch):
        self.got.extend(batch)


def test_enqueue_never_blocks_and_counts_drops():
    rec = _Recorder("r")
    d = Dispatcher([rec], queue_size=2)  # not started: nothing drains the queue
    n = Notification(status="firing", labels={"alertname": "A"})
    for _ in range(5):
        d.enqueue(n)
    assert d.stats()["r"] == {"sent": 0, "failed": 0, "dropped": 3, "retries": 0, "queued": 2}
    d.start()
    wait_until(lambda: d.stats()["r"]["sent"] == 2)
    d.stop()


def test_repeats_go_only_to_receivers_that_expire_alerts():
    plain, am = _Recorder("plain"), _Recorder("am", repeats=True)
    d = Dispatcher([plain, am])
    d.enqueue(Notification(status="firing", labels={"alertname": "A"}))
    d.enqueue(Notification(status="firing", labels={"alertname": "A"}, repeat=True))
    d.start()
    d.stop()
    assert len(plain.got) == 1 and len(am.got) == 2


def test_dedup_key_is_stable_and_bounded():
    labels = {"alertname": "ParamDrift", "severity": "page", "run": "r", "param": "p" * 400}
    key = dedup_key(labels)
    assert len(key) == 255 and key == dedup_key(dict(reversed(list(labels.items()))))
    assert key != dedup_key({**labels, "param": "p" * 399 + "q"})
    assert dedup_key({**labels, "severity": "warning"}) == key  # severity is not identity


def test_observe_batch_takes_a_whole_ingest_body():
    svc = service([])
    batch = ReportBatch(
        schema=1,
        reports=[
            wire_report(0, [("modality_dilution_ratio", {"modality": "image"}, 17.0)], run="a"),
            wire_report(0, [("modality_dilution_ratio", {"modality": "image"}, 17.0)], run="b"),
        ],
    )
    assert sorted(t.labels["run"] for t in svc.observe_batch(batch, 10.0)) == ["a", "b"]
    names = [f.name for f in svc.metric_families()]
    assert names == ["trainvitals_alerts_firing", "trainvitals_alerts_suppressed"]  # no notifiers


def test_service_views_and_metrics(monkeypatch):
    svc = service([{"type": "webhook", "url": "http://127.0.0.1:9"}])
    fire(svc, 0, 17.0, modality="image", now=100.0)
    fire(svc, 0, 9.0, modality="audio", now=100.0)
    fire(svc, 10, 1.0, modality="audio", now=110.0)
    alerts = svc.alerts()
    assert [(a["state"], a["labels"]["modality"]) for a in alerts] == [("firing", "image"), ("resolved", "audio")]
    first = alerts[0]
    assert first["alertname"] == "GradientDilution" and first["value"] == 17.0 and first["since"] == 100.0
    assert first["severity"] == "page" and first["summary"].startswith("image gets 17.0x")
    assert alerts[1]["resolved_at"] == 110.0
    assert first["fired_at_time"] == "1970-01-01T00:01:40.000Z" and alerts[1]["resolved_at_time"].endswith("01:50.000Z")
    assert alerts[1]["summary"] == (
        "Resolved: GradientDilution in run r1 (modality=audio) at step 10: modality_dilution_ratio is back to 1 "
        "(clears at <= 3) after firing for 10 s; it fired at 9"
    )
    assert alerts[1]["description"] == "While it fired: audio gets 9.0x less gradient in run r1. diluted"
    assert [a["labels"]["modality"] for a in svc.alerts(states=["resolved"])] == ["audio"]
    assert svc.alerts(run="other") == [] and len(svc.alerts(run="r1")) == 2

    registry = CollectorRegistry()
    registry.register(svc)
    page = {"alertname": "GradientDilution", "severity": "page"}
    assert registry.get_sample_value("trainvitals_alerts_firing", {**page, "run": "r1"}) == 1
    fire(svc, 0, 1.0, run="quiet", now=120.0)
    assert registry.get_sample_value("trainvitals_alerts_firing", {**page, "run": "quiet"}) == 0
    assert (
        registry.get_sample_value("trainvitals_notifications_total", {"notifier": "webhook", "outcome": "dropped"}) == 0
    )
    assert registry.get_sample_value("trainvitals_notifications_queued", {"notifier": "webhook"}) == 3
    svc.stop(timeout=0.1)
