"""Every page links to something that opens: runbook pages served by the collector, the
run's page as generatorURL, the same links in every notifier's payload, and firing
alerts re-sent before the endsAt they carry lapses."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.http_recorder import RecordingServer
from tests.reports import make_body, make_report, make_sample
from tests.support import running_collector, wait_until
from trainvitals.alerts.loading import resolve_rules
from trainvitals.alerts.runbooks import render_page, runbook_for, runbooks
from trainvitals.alerts.state import Alert, AlertState

DEFAULT_RULES = resolve_rules("default")


def test_every_default_rule_names_a_runbook_section_and_every_section_a_rule():
    sections = runbooks()
    names = {r.alert for r in DEFAULT_RULES}
    for rule in DEFAULT_RULES:
        book = runbook_for(rule.runbook)
        assert book is not None and book.title == rule.alert, rule.alert
    assert {b.title for b in sections.values()} == names


def test_runbook_page_holds_its_own_section_only():
    page = render_page("paramdrift")
    assert page is not None and "<h2>ParamDrift</h2>" in page
    assert "<h2>GradientDilution</h2>" not in page
    assert render_page("ParamDrift") == page
    assert render_page("nosuchalert") is None
    # Links into the repository's docs cannot open from the collector: no dead hrefs.
    assert "../docs/" not in page


def _report(run: str, step: int, value: float, events=None) -> dict:
    return make_report(
        run,
        step,
        [
            make_sample("modality_excess_dilution_ratio", value, modality="image"),
            make_sample("modality_excess_dilution_ratio", 0.85, modality="text"),
        ],
        events=events,
    )


def test_each_default_rules_runbook_link_opens_on_the_collector():
    with running_collector(read_token="secret-read") as c:
        service = c.app.state.alerts
        assert service.external_url == c.url
        for rule in DEFAULT_RULES:
            alert = Alert(rule, {"run": "r"}, AlertState.FIRING, 1.0, 10, 0.0, 0.0, None)
            url = service.runbook_url(alert)
            assert url == f"{c.url}/runbooks/{rule.alert.lower()}"
            page = httpx.get(url, timeout=10)  # no token: a link from a phone must open
            assert page.status_code == 200, rule.alert
            assert page.headers["content-type"].startswith("text/html")
            assert re.findall(r"<h2>(\w+)</h2>", page.text) == [rule.alert]
        index = httpx.get(f"{c.url}/runbooks", timeout=10)
        assert index.status_code == 200
        assert all(f"id='{r.alert.lower()}'" in index.text for r in DEFAULT_RULES)
        missing = httpx.get(f"{c.url}/runbooks/nope", timeout=10)
        assert missing.status_code == 404 and "paramdrift" in missing.json()["detail"]
        assert httpx.get(f"{c.url}/v1/alerts", timeout=10).status_code == 401  # the rest stays guarded


def _links_everywhere(external_url: str | None):
    """Fire and resolve GradientDilution through a collector with webhook, Slack and
    PagerDuty notifiers pointing at recorders; return (collector url, bodies per notifier)."""
    with RecordingServer() as hook, RecordingServer() as slack, RecordingServer(default=202) as pd:
        alerts: dict = {"resend_interval": 1, "ends_at_horizon": 3, "tick_interval": 0.1}
        if external_url:
            alerts["external_url"] = external_url
        with running_collector(
            notifiers=[
                {"type": "webhook", "url": hook.url + "/hook"},
                {"type": "slack", "webhook_url": slack.url + "/slack"},
                {"type": "pagerduty", "url": pd.url, "routing_key": "rk-123"},
            ],
            alerts=alerts,
        ) as c:
            for step in (0, 10, 20):
                assert c.client.post("/v1/reports", json=make_body(_report("mm/pt-1", step, 17.0))).status_code == 202
            c.wait_for("GradientDilution", "mm/pt-1")
            wait_until(lambda: hook.count() >= 3, 60, "webhook re-sends")  # first + two re-sends
            assert slack.count() == 1 and pd.count() == 1  # no endsAt there: sent once
            end = make_body(_report("mm/pt-1", 30, 17.0, events=[{"kind": "run_end", "labels": {}, "detail": ""}]))
            assert c.client.post("/v1/reports", json=end).status_code == 202
            wait_until(lambda: slack.count() == 2 and pd.count() == 2, 60, "resolves")
            wait_until(lambda: any(b["status"] == "resolved" for b in hook.bodies()), 60, "webhook resolve")
            return c.url, hook.bodies(), slack.bodies(), pd.bodies()


@pytest.mark.parametrize("external", [None, "https://tv.example.org/"])
def test_webhook_slack_and_pagerduty_payloads_carry_the_links(external):
    url, hook, slack, pd = _links_everywhere(external)
    base = (external or url).rstrip("/")
    runbook = f"{base}/runbooks/gradientdilution"
    run_page = f"{base}/runs/mm/pt-1"  # run names are URL-path safe as they are

    firing = [a for b in hook if b["status"] == "firing" for a in b["alerts"]]
    assert len(firing) >= 3
    for a in firing:
        assert a["annotations"]["runbook_url"] == runbook and a["generatorURL"] == run_page
    # Each re-send moves endsAt ahead: a receiver honouring it never drops the incident.
    ends = [a["endsAt"] for a in firing]
    assert ends == sorted(ends) and len(set(ends)) == len(ends)
    (resolved,) = [a for b in hook if b["status"] == "resolved" for a in b["alerts"]]
    assert resolved["annotations"]["summary"].startswith(
        "Resolved: GradientDilution in run mm/pt-1 (modality=image): run mm/pt-1 ended at step 30 after firing for"
    )
    assert resolved["annotations"]["description"].startswith(
        "While it fired: Run mm/pt-1, step 30: image samples get 17.0x less gradient"
    )
    assert resolved["generatorURL"] == run_page and resolved["annotations"]["runbook_url"] == runbook

    s_fire, s_resolved = slack
    assert f"<{runbook}|runbook>" in str(s_fire["blocks"]) and f"<{run_page}|run>" in str(s_fire["blocks"])
    assert "RESOLVED" in s_resolved["text"] and "ended at step 30" in s_resolved["text"]

    p_fire, p_resolve = pd
    assert p_fire["event_action"] == "trigger" and p_fire["client_url"] == run_page
    assert {"href": runbook, "text": "Runbook"} in p_fire["links"]
    assert {"href": run_page, "text": "Run"} in p_fire["links"]
    assert p_fire["payload"]["custom_details"]["runbook_url"] == runbook
    assert p_resolve == {"routing_key": "rk-123", "dedup_key": p_fire["dedup_key"], "event_action": "resolve"}
