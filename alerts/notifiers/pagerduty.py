"""PagerDuty Events API v2: ``POST {url}/v2/enqueue``, trigger and resolve.

The ``dedup_key`` comes from the alert's labels (stable across re-sends and
collector restarts), so a resolve closes the incident its trigger opened.
Answers: 202 accepted; 400 is a bad event (never retried); 429 and 5xx are
retried with backoff.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trainvitals.alerts.notifiers.base import HttpNotifier, Notification, rfc3339

__all__ = ["PAGERDUTY_SEVERITY", "PagerDutyNotifier", "pagerduty_event"]

DEFAULT_URL = "https://events.pagerduty.com"

# Rule severity -> PagerDuty payload severity.
PAGERDUTY_SEVERITY = {
    "critical": "critical",
    "page": "critical",
    "error": "error",
    "warning": "warning",
    "ticket": "warning",
    "info": "info",
}


def pagerduty_event(n: Notification, routing_key: str) -> dict[str, Any]:
    """The Events v2 body for one notification."""
    event: dict[str, Any] = {"routing_key": routing_key, "dedup_key": n.dedup_key()}
    if not n.firing:
        event["event_action"] = "resolve"
        return event
    labels = dict(n.labels)
    run = labels.get("run", "")
    summary = n.annotations.get("summary") or n.alertname
    details: dict[str, str | float] = {k: v for k, v in labels.items() if k not in ("alertname", "severity")}
    details["value"] = n.value
    for key in ("description", "runbook_url"):
        if n.annotations.get(key):
            details[key] = n.annotations[key]
    event.update(
        event_action="trigger",
        client="trainvitals",
        payload={
            "summary": f"[{n.alertname}] {summary}"[:1024],
            "source": run or "trainvitals",
            "severity": PAGERDUTY_SEVERITY.get(n.severity, "warning"),
            "timestamp": rfc3339(n.starts_at),
            "component": "trainvitals",
            "group": run,
            "class": n.alertname,
            "custom_details": details,
        },
    )
    if n.generator_url:
        event["client_url"] = n.generator_url
    links = []
    runbook = n.annotations.get("runbook_url", "")
    if runbook.startswith(("http://", "https://")):
        links.append({"href": runbook, "text": "Runbook"})
    if n.generator_url.startswith(("http://", "https://")):
        links.append({"href": n.generator_url, "text": "Run"})
    if links:
        event["links"] = links
    return event


class PagerDutyNotifier(HttpNotifier):
    """Triggers and resolves PagerDuty incidents, one event per request."""

    def __init__(self, name: str, routing_key: str, *, url: str = DEFAULT_URL, timeout: float = 10.0) -> None:
        super().__init__(name, timeout=timeout)
        self._routing_key = routing_key
        self._endpoint = url.rstrip("/") + "/v2/enqueue"

    def send(self, batch: Sequence[Notification]) -> None:
        for n in batch:
            self.post(self._endpoint, pagerduty_event(n, self._routing_key))
