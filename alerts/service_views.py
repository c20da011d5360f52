"""What the alert service shows: the ``GET /v1/alerts`` rows and its Prometheus families.

Views of the service's state, apart from the evaluation, notification and persistence
in :mod:`trainvitals.alerts.service` (whose ``alerts()`` and ``metric_families()`` call
these). They read the service through :class:`ServiceView`, the little of it they need,
so that this module does not import the service.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from trainvitals.alerts.engine import Engine
from trainvitals.alerts.notifiers.base import rfc3339
from trainvitals.alerts.state import Alert, AlertState
from trainvitals.wire import METRICS, PREFIX, exposed_family

__all__ = ["ServiceView", "alert_rows", "metric_families"]


class ServiceView(Protocol):
    """What the views read of an :class:`~trainvitals.alerts.service.AlertService`."""

    engine: Engine

    def runbook_url(self, a: Alert) -> str: ...

    def run_url(self, run: str) -> str: ...

    def stats(self) -> dict[str, dict[str, int]]: ...


def alert_rows(
    service: ServiceView,
    include_pending: bool = True,
    *,
    run: str | None = None,
    states: Iterable[AlertState | str] | None = None,
) -> list[dict[str, Any]]:
    """``GET /v1/alerts``: firing, pending and recently resolved alerts, as JSON-ready dicts.

    ``run``: that run's only; ``states``: those states only (``firing``, ``pending``,
    ``resolved``). Times are Unix seconds, each with its RFC 3339 twin (``fired_at`` and
    ``fired_at_time``); ``runbook_url`` and ``generator_url`` are the links notifications carry.
    """
    # engine.alerts() leaves inactive ones out: these three states are all there is.
    order = {AlertState.FIRING: 0, AlertState.PENDING: 1, AlertState.RESOLVED: 2}
    wanted = {AlertState(x) for x in states} if states is not None else None
    shown = sorted(
        (
            a
            for a in service.engine.alerts()
            if (include_pending or a.state is not AlertState.PENDING)
            and (wanted is None or a.state in wanted)
            and (run is None or a.labels.get("run") == run)
        ),
        key=lambda a: (order[a.state], a.alertname, sorted(a.labels.items())),
    )
    out = []
    for a in shown:
        resolved = a.state is AlertState.RESOLVED
        row: dict[str, Any] = {
            "alertname": a.alertname,
            "labels": dict(a.labels),
            "state": a.state.value,
            "value": a.value if math.isfinite(a.value) else None,
            "fired_value": a.fired_value if math.isfinite(a.fired_value) else None,
            "since": a.since,
            "severity": a.severity,
            "summary": a.resolved_summary() if resolved else a.summary,
            "description": a.resolved_description() if resolved else a.description,
            "runbook": a.rule.runbook,
            "runbook_url": service.runbook_url(a),
            "generator_url": service.run_url(a.labels.get("run", "")) if a.labels.get("run") else "",
            "step": a.step,
            "fired_at": a.fired_at,
            "resolved_at": a.resolved_at,
            "resolved_reason": a.resolved_reason or None,
        }
        for name in ("since", "fired_at", "resolved_at"):
            t = row[name]
            row[name + "_time"] = rfc3339(t) if t is not None else None
        out.append(row)
    return out


def metric_families(service: ServiceView) -> Iterator[Metric]:
    """Fresh metric families for the collector's exposition (a prometheus Collector)."""
    firing = GaugeMetricFamily(
        PREFIX + "alerts_firing", METRICS["alerts_firing"].help, labels=["alertname", "severity", "run"]
    )
    # Every rule for every live run, 0 when quiet: a dashboard filtered by run shows 0, not
    # "no data", for a run that is watched and healthy.
    rules = sorted({(r.alert, r.severity) for r in service.engine.rules})
    counts: dict[tuple[str, str, str], int] = {
        (name, severity, run): 0 for run in service.engine.run_names() for name, severity in rules
    }
    for a in service.engine.firing():
        key = (a.alertname, a.severity, a.labels.get("run", ""))
        counts[key] = counts.get(key, 0) + 1
    for (name, severity, run), n in sorted(counts.items()):
        firing.add_metric([name, severity, run], n)
    yield firing
    suppressed = CounterMetricFamily(
        PREFIX + "alerts_suppressed", METRICS["alerts_suppressed_total"].help, labels=["alertname"]
    )
    flood = dict(service.engine.suppressed)
    for name in sorted({r.alert for r in service.engine.rules} | set(flood)):
        suppressed.add_metric([name], flood.get(name, 0))
    yield suppressed
    stats = service.stats()
    if not stats:
        return
    sent = CounterMetricFamily(
        PREFIX + exposed_family("notifications_total"),
        METRICS["notifications_total"].help,
        labels=["notifier", "outcome"],
    )
    retries = CounterMetricFamily(
        PREFIX + exposed_family("notification_retries_total"),
        METRICS["notification_retries_total"].help,
        labels=["notifier"],
    )
    queued = GaugeMetricFamily(
        PREFIX + "notifications_queued", METRICS["notifications_queued"].help, labels=["notifier"]
    )
    for name, c in sorted(stats.items()):
        for outcome in ("sent", "failed", "dropped"):
            sent.add_metric([name, outcome], c[outcome])
        retries.add_metric([name], c["retries"])
        queued.add_metric([name], c["queued"])
    yield from (sent, retries, queued)
