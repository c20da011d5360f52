"""A real Alertmanager receives firing and resolved alerts from AlertService.

Chain: wire Reports -> AlertService (default rules) -> AlertmanagerNotifier ->
prometheus-alertmanager (Debian package) -> webhook receiver (a local recording
server) with send_resolved.
"""

from __future__ import annotations

import os
import time
from datetime import datetime

import httpx
import pytest

from tests.http_recorder import RecordingServer
from tests.reports import make_body, make_report, make_sample, wire_report
from tests.support import needs_tools, running_alertmanager, running_collector, wait_until
from trainvitals.alerts.service import AlertService

pytestmark = [
    pytest.mark.integration,
    needs_tools("prometheus-alertmanager"),
]


@pytest.fixture
def alertmanager(tmp_path):
    """(Alertmanager URL, recording webhook receiver)."""
    with (
        RecordingServer() as receiver,
        running_alertmanager(tmp_path / "alertmanager", receiver.url, group_by=("alertname", "run", "modality")) as url,
    ):
        yield url, receiver


def _dilution(step: int, value: float):
    return wire_report(
        step,
        [
            ("modality_excess_dilution_ratio", {"modality": "image"}, value),
            ("modality_excess_dilution_ratio", {"modality": "text"}, 0.85),
        ],
        run="mm-pt1",
        time=time.time(),
    )


def _webhooks(receiver: RecordingServer, status: str) -> list[dict]:
    return [b for b in receiver.bodies() if b.get("status") == status]


def test_alertmanager_delivers_firing_then_resolved(alertmanager):
    url, receiver = alertmanager
    service = AlertService.from_config("default", [{"type": "alertmanager", "url": url}], resend_interval=5)
    with service:
        # I1 values: dilution 17x for three reports (for_steps 20), then the fix.
        for step in (0, 10, 20):
            service.observe(_dilution(step, 17.0))
        assert [a["state"] for a in service.alerts()] == ["firing"]

        (firing,) = wait_until(lambda: _webhooks(receiver, "firing"), timeout=60)
        (alert,) = firing["alerts"]
        assert alert["labels"] == {
            "alertname": "GradientDilution",
            "severity": "page",
            "run": "mm-pt1",
            "modality": "image",
        }
        assert alert["annotations"]["summary"] == (
            "Run mm-pt1, step 20: image samples get 17.0x less gradient than the job's intended loss "
            "normalization gives them; check how the loss is normalized (per token instead of per sample?)"
        )
        assert alert["annotations"]["runbook_url"] == "RUNBOOKS.md#gradientdilution"  # no external URL here

        service.observe(_dilution(30, 1.0))
        (resolved,) = wait_until(lambda: _webhooks(receiver, "resolved"), timeout=60)
        assert [a["labels"]["alertname"] for a in resolved["alerts"]] == ["GradientDilution"]
        assert resolved["alerts"][0]["status"] == "resolved"
    stats = service.stats()["alertmanager"]
    assert stats["sent"] >= 2 and stats["failed"] == 0 and stats["dropped"] == 0


# The time scale of the long-incident test, in seconds. The collector's defaults are a
# re-send every 60 s with endsAt 240 s ahead; a 10-minute incident is 2.5 of those
# horizons. Here the incident lasts SPAN_S = 10 horizons of a scaled-down notifier (the
# same code, every interval divided by 30), so a lapse between two re-sends shows many
# times over. TRAINVITALS_TEST_INCIDENT_SCALE=30 runs it at the defaults (a real
# 10-minute incident: 25 minutes in all).
_SCALE = float(os.environ.get("TRAINVITALS_TEST_INCIDENT_SCALE", "1"))
RESEND_S = 2.0 * _SCALE
HORIZON_S = 8.0 * _SCALE
SPAN_S = 10 * HORIZON_S if _SCALE == 1 else 600.0


def _am_active(url: str, run: str) -> list[dict]:
    """The alerts Alertmanager holds as active for ``run`` (its API v2)."""
    got = httpx.get(f"{url}/api/v2/alerts", params={"filter": f'run="{run}"'}, timeout=5)
    got.raise_for_status()
    return [a for a in got.json() if a["status"]["state"] == "active"]


def _unix(rfc3339: str) -> float:
    """Unix seconds of an RFC 3339 time as Alertmanager writes it (``...T08:00:00.123Z``)."""
    return datetime.fromisoformat(rfc3339).timestamp()


def _post(collector, step: int, value: float, run: str, events: list | None = None) -> None:
    body = make_body(
        make_report(
            run,
            step,
            [
                make_sample("modality_excess_dilution_ratio", value, modality="image"),
                make_sample("modality_excess_dilution_ratio", 0.85, modality="text"),
            ],
            events=events,
            time=time.time(),
        )
    )
    assert collector.client.post("/v1/reports", json=body).status_code == 202


@pytest.mark.slow
def test_alertmanager_keeps_a_long_incident_firing_and_resolves_it_within_one_interval(tmp_path):
    # Two runs with the same incident over one span: one clears, the other ends.
    runs = {"llm-long-clears": "clears", "llm-long-ends": "run ends"}
    with (
        RecordingServer() as receiver,
        running_alertmanager(tmp_path / "am", receiver.url, group_by=("alertname", "run", "modality")) as am,
        running_collector(
            notifiers=[{"type": "alertmanager", "url": am}],
            alerts={"resend_interval": RESEND_S, "ends_at_horizon": HORIZON_S, "tick_interval": 0.25},
        ) as collector,
    ):
        for run in runs:
            for step in (0, 10, 20):
                _post(collector, step, 17.0, run)
            collector.wait_for("GradientDilution", run)
        for run in runs:
            wait_until(lambda run=run: _am_active(am, run), 60, f"run {run}'s alert in Alertmanager")
        # Polled over the span, each run's alert is active at every poll, and the endsAt it
        # held at one poll reaches past the end of the next: no lapse in between, however
        # far apart a loaded machine spaced the polls. Each endsAt is within one horizon of
        # its poll: kept alive by re-sends, not by one long endsAt. (Only a test thread held
        # off for over HORIZON_S - RESEND_S = 6 s between two polls, against ~0.3 s here,
        # could fail a healthy run: the margin is by design, twenty times the usual gap.)
        start = time.monotonic()
        step, polls, last_report = 20, 0, start
        held_until: dict[str, float] = {}
        while time.monotonic() - start < SPAN_S:
            for run in runs:
                (held,) = _am_active(am, run)
                seen = time.time()
                assert held["labels"]["alertname"] == "GradientDilution"
                if run in held_until:
                    assert held_until[run] >= seen, f"run {run}'s alert lapsed between two polls"
                held_until[run] = _unix(held["endsAt"])
                assert held_until[run] <= seen + HORIZON_S + 0.001, (held, seen)
            polls += 1
            if time.monotonic() - last_report > 5:  # the jobs keep reporting the same incident
                step += 10
                for run in runs:
                    _post(collector, step, 17.0, run)
                last_report = time.monotonic()
            time.sleep(0.25)
        assert polls >= 2
        sent = collector.app.state.alerts.stats()["alertmanager"]
        # Held over SPAN_S with each endsAt at most HORIZON_S ahead: re-sent at least every horizon.
        assert sent["sent"] >= SPAN_S / HORIZON_S and sent["failed"] == 0, sent

        resolved_between: dict[str, tuple[float, float]] = {}
        for run, ending in runs.items():
            before = time.time()
            if ending == "clears":
                _post(collector, step + 10, 1.0, run)
            else:
                _post(collector, step + 10, 17.0, run, events=[{"kind": "run_end", "labels": {}, "detail": ""}])
            resolved_between[run] = (before, time.time())
            (ours,) = collector.alerts(run)
            assert ours["state"] == "resolved"
        for run in runs:
            wait_until(lambda run=run: not _am_active(am, run), 60, f"run {run}'s alert resolved in Alertmanager")

        # What the on-call receives through Alertmanager reads as resolved, with the reason.
        def resolved_notice(run: str) -> list[dict]:
            return [
                a
                for b in receiver.bodies()
                if b.get("status") == "resolved"
                for a in b["alerts"]
                if a["labels"]["run"] == run
            ]

        for run, ending in runs.items():
            (notice,) = wait_until(lambda run=run: resolved_notice(run), 60, f"run {run}'s resolved notice")
            # Resolved by the collector's resolve (endsAt = the moment it resolved), not by
            # letting the last endsAt lapse (up to HORIZON_S later).
            first, last = resolved_between[run]
            assert first - 0.001 <= _unix(notice["endsAt"]) <= last, (notice["endsAt"], first, last)
            summary = notice["annotations"]["summary"]
            assert summary.startswith(f"Resolved: GradientDilution in run {run} (modality=image)")
            if ending == "clears":
                assert "is back to 1 (clears at <= 3)" in summary and "it fired at 17" in summary
            else:
                assert f"run {run} ended at step {step + 10}" in summary
            assert "after firing for" in summary
            assert notice["generatorURL"] == f"{collector.url}/runs/{run}"
            page = httpx.get(notice["annotations"]["runbook_url"], timeout=5)
            assert page.status_code == 200 and "<h2>GradientDilution</h2>" in page.text
