"""What a notification says: built from an alert, with its links.

:class:`NotificationBuilder` turns an :class:`~trainvitals.alerts.state.Alert` into the
:class:`~trainvitals.alerts.notifiers.base.Notification` every notifier sends: the
firing summary and description, or for a resolved one why it resolved (the value it
cleared at, or the run ended) and how long it fired; ``ends_at`` ``ends_at_horizon``
seconds ahead while it fires, so a receiver that honours it keeps a firing alert while
the collector lives and expires it if the collector dies.

Links: ``runbook_url`` is absolute, the collector's own page of the alert's runbook
(``{external_url}/runbooks/{anchor}``, :mod:`trainvitals.alerts.runbooks`) unless the
rule names a URL or ``runbook_base_url`` puts the runbooks elsewhere; ``generatorURL``
is the run's page, ``{external_url}/runs/{run}``. The collector sets ``external_url``
to where it serves (:meth:`~NotificationBuilder.serving_at`) unless the configuration
names one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from trainvitals.alerts.notifiers.base import Notification
from trainvitals.alerts.runbooks import runbook_url
from trainvitals.alerts.state import Alert, AlertState

__all__ = ["NotificationBuilder"]


class NotificationBuilder:
    """Notifications and links of alerts, for one collector's base URL."""

    def __init__(
        self,
        ends_at_horizon: float,
        *,
        external_url: str | None = None,
        external_url_default: bool = False,
        runbook_base_url: str | None = None,
    ) -> None:
        self.ends_at_horizon = ends_at_horizon
        self.external_url = external_url.rstrip("/") if external_url else ""
        # A configured external URL wins over where serve binds (a proxy, a DNS name).
        self._external_url_given = bool(external_url) and not external_url_default
        self.runbook_base_url = runbook_base_url

    def serving_at(self, url: str) -> None:
        """Where the collector serves (its base URL): the links' base unless ``external_url``
        was configured."""
        if not self._external_url_given:
            self.external_url = url.rstrip("/")

    def runbook_url(self, a: Alert) -> str:
        """The absolute runbook link of ``a`` (see the module doc)."""
        return runbook_url(a.rule.runbook, self.external_url, self.runbook_base_url)

    def run_url(self, run: str) -> str:
        """The run's page, ``generatorURL`` (empty without an external URL)."""
        return f"{self.external_url}/runs/{quote(run, safe='/:')}" if self.external_url else ""

    def notification(self, a: Alert, now: float, *, repeat: bool = False) -> Notification:
        """``a`` as its notifiers get it: firing (``repeat``: a re-send) or resolved."""
        firing = a.state is AlertState.FIRING
        if firing:
            annotations = {"summary": a.summary, "description": a.description}
        else:
            annotations = {"summary": a.resolved_summary(now), "description": a.resolved_description()}
        annotations["runbook_url"] = self.runbook_url(a)
        return Notification(
            status="firing" if firing else "resolved",
            labels=a.alert_labels,
            annotations=annotations,
            starts_at=a.fired_at if a.fired_at is not None else now,
            ends_at=now + self.ends_at_horizon if firing else (a.resolved_at or now),
            value=a.value,
            generator_url=self.run_url(a.labels.get("run", "")) if a.labels.get("run") else "",
            repeat=repeat,
        )

    @staticmethod
    def resolve_of(sent: Mapping[str, Any], a: Alert | None, now: float) -> Notification:
        """The resolve owed for a firing notification ``sent`` before a restart: ``a`` is
        the alert now (resolved), None when its rule is gone or its run was forgotten."""
        ended = a.resolved_at if a is not None and a.resolved_at is not None else now
        value = sent.get("value")
        if a is not None:
            annotations = {
                **sent["annotations"],
                "summary": a.resolved_summary(now),
                "description": a.resolved_description(),
            }
        else:
            labels = sent["labels"]
            series = ", ".join(f"{k}={v}" for k, v in labels.items() if k not in ("alertname", "severity", "run"))
            annotations = {
                **sent["annotations"],
                "summary": f"Resolved: {labels.get('alertname', '?')} in run {labels.get('run', '?')}"
                + (f" ({series})" if series else "")
                + ": its rule is gone, or its run was forgotten, while the collector was down",
                "description": "While it fired: " + sent["annotations"].get("summary", ""),
            }
        return Notification(
            status="resolved",
            labels=sent["labels"],
            annotations=annotations,
            starts_at=sent["starts_at"],
            ends_at=ended,
            value=math.nan if value is None else value,
            generator_url=sent.get("generator_url", ""),
        )
