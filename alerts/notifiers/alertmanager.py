"""Alertmanager API v2: ``POST {url}/api/v2/alerts`` with a list of alerts.

Alertmanager expires a firing alert at its ``endsAt``: clients re-send firing
alerts periodically with ``endsAt`` ahead (the service re-sends every
``resend_interval`` with ``endsAt = now + 4 * resend_interval``, as Prometheus
does) and resolve by sending the same labels with ``endsAt = now``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trainvitals.alerts.notifiers.base import HttpNotifier, Notification, rfc3339

__all__ = ["AlertmanagerNotifier", "alertmanager_payload"]


def alertmanager_payload(batch: Sequence[Notification]) -> list[dict[str, Any]]:
    """The JSON body for ``POST /api/v2/alerts``."""
    out = []
    for n in batch:
        alert: dict[str, Any] = {
            "labels": dict(n.labels),
            "annotations": {k: v for k, v in n.annotations.items() if v},
            "startsAt": rfc3339(n.starts_at),
        }
        if n.ends_at is not None:
            alert["endsAt"] = rfc3339(n.ends_at)
        if n.generator_url:
            alert["generatorURL"] = n.generator_url
        out.append(alert)
    return out


class AlertmanagerNotifier(HttpNotifier):
    """Pushes alerts to one Alertmanager (for an HA pair, configure one per instance)."""

    wants_repeats = True
    max_batch = 64

    def __init__(self, name: str, url: str, *, timeout: float = 10.0, headers: dict[str, str] | None = None) -> None:
        super().__init__(name, timeout=timeout, headers=headers)
        self._endpoint = url.rstrip("/") + "/api/v2/alerts"

    def send(self, batch: Sequence[Notification]) -> None:
        self.post(self._endpoint, alertmanager_payload(batch))
