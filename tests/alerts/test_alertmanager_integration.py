"""A real Alertmanager receives firing and resolved alerts from AlertService.

Chain: wire Reports -> AlertService (default rules) -> AlertmanagerNotifier ->
prometheus-alertmanager (Debian package) -> webhook receiver (a local recording
server) with send_resolved.
"""

from __future__ import annotations

import time

import pytest

from tests.http_recorder import RecordingServer
from tests.reports import wire_report
from tests.support import ALERTMANAGER, running_alertmanager, wait_until
from trainvitals.alerts.service import AlertService

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(ALERTMANAGER is None, reason="prometheus-alertmanager not installed"),
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

        (firing,) = wait_until(lambda: _webhooks(receiver, "firing"), timeout=30)
        (alert,) = firing["alerts"]
        assert alert["labels"] == {
            "alertname": "GradientDilution",
            "severity": "page",
            "run": "mm-pt1",
            "modality": "image",
        }
        assert alert["annotations"]["summary"] == (
            "image gets 17.0x less gradient than the intended loss normalization gives it in run mm-pt1"
        )
        assert alert["annotations"]["runbook_url"] == "RUNBOOKS.md#gradientdilution"

        service.observe(_dilution(30, 1.0))
        (resolved,) = wait_until(lambda: _webhooks(receiver, "resolved"), timeout=30)
        assert [a["labels"]["alertname"] for a in resolved["alerts"]] == ["GradientDilution"]
        assert resolved["alerts"][0]["status"] == "resolved"
    stats = service.stats()["alertmanager"]
    assert stats["sent"] >= 2 and stats["failed"] == 0 and stats["dropped"] == 0
