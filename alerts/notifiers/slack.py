"""Slack incoming webhook: ``{"text": ..., "blocks": [...]}``.

``text`` is the notification fallback (phone banners, screen readers); the
blocks carry the summary, description, labels, the runbook and the run's page. 200 with ``ok`` on
success; 429 when rate limited (retried, honouring Retry-After).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trainvitals.alerts.notifiers.base import HttpNotifier, Notification

__all__ = ["SlackNotifier", "slack_message"]

_EMOJI = {"firing": ":rotating_light:", "resolved": ":white_check_mark:"}


def _esc(text: str) -> str:
    """Escape Slack mrkdwn control characters."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def slack_message(n: Notification) -> dict[str, Any]:
    """The webhook body for one notification."""
    status = "FIRING" if n.firing else "RESOLVED"
    summary = n.annotations.get("summary") or n.alertname
    emoji = _EMOJI["firing" if n.firing else "resolved"]
    if n.firing:
        text = f"{emoji} [{status}] {n.alertname}: {summary}"
    else:  # the resolved summary names the alert itself: "Resolved: X in run r: ..."
        text = f"{emoji} [{status}] {summary.removeprefix('Resolved: ')}"
    labels = " ".join(f"`{_esc(k)}={_esc(v)}`" for k, v in n.labels.items() if k not in ("alertname", "severity"))
    context = f"severity: *{_esc(n.severity)}*  {labels}"
    runbook = n.annotations.get("runbook_url", "")
    if runbook.startswith(("http://", "https://")):
        context += f"  <{runbook}|runbook>"
    elif runbook:
        context += f"  runbook: {_esc(runbook)}"
    if n.generator_url.startswith(("http://", "https://")):
        context += f"  <{n.generator_url}|run>"
    blocks: list[dict[str, Any]] = [
        {
            "type": "section",
            "text": {"type": "mrkdwn", "text": f"{emoji} *[{status}] {_esc(n.alertname)}*\n{_esc(summary)}"},
        },
    ]
    if n.firing and n.annotations.get("description"):
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": _esc(n.annotations["description"])}})
    blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": context}]})
    return {"text": text, "blocks": blocks}


class SlackNotifier(HttpNotifier):
    """Posts one message per notification to an incoming webhook."""

    def __init__(self, name: str, webhook_url: str, *, timeout: float = 10.0) -> None:
        super().__init__(name, timeout=timeout)
        self._url = webhook_url

    def send(self, batch: Sequence[Notification]) -> None:
        for n in batch:
            self.post(self._url, slack_message(n))
