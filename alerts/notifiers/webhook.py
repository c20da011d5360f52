"""Generic JSON webhook, shaped like Alertmanager's webhook receiver body.

A firing alert carries ``endsAt`` (the time a receiver may consider it over without
news), so it is re-sent every ``resend_interval`` like Alertmanager's (``repeat``
notifications, marked ``"repeat": true``): a receiver that honours ``endsAt`` keeps a
still-true incident, and one that pages per message can skip the repeats.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from trainvitals.alerts.notifiers.base import HttpNotifier, Notification, rfc3339

__all__ = ["WebhookNotifier", "webhook_payload"]


def webhook_payload(batch: Sequence[Notification]) -> dict[str, Any]:
    """``{"version": "1", "source": "trainvitals", "status", "alerts": [...]}``."""
    alerts = []
    for n in batch:
        alerts.append(
            {
                "status": n.status,
                "labels": dict(n.labels),
                "annotations": dict(n.annotations),
                "startsAt": rfc3339(n.starts_at),
                "endsAt": rfc3339(n.ends_at) if n.ends_at is not None else None,
                "value": n.value if math.isfinite(n.value) else None,
                "generatorURL": n.generator_url,
                "fingerprint": n.dedup_key(),
                # A periodic re-send of a firing alert already sent: not a new page.
                "repeat": n.repeat,
            }
        )
    status = "firing" if any(n.firing for n in batch) else "resolved"
    return {"version": "1", "source": "trainvitals", "status": status, "alerts": alerts}


class WebhookNotifier(HttpNotifier):
    """POSTs batches of notifications as JSON to any URL, with optional headers."""

    wants_repeats = True
    max_batch = 32

    def __init__(self, name: str, url: str, *, headers: Mapping[str, str] | None = None, timeout: float = 10.0) -> None:
        super().__init__(name, timeout=timeout, headers=dict(headers or {}))
        self._url = url

    def send(self, batch: Sequence[Notification]) -> None:
        self.post(self._url, webhook_payload(batch))
