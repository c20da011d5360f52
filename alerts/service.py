"""The collector's alerting: engine + notifiers + timers, behind one object.

::

    service = AlertService.from_config(rules="default", notifiers=cfg.notifiers)
    service.start()                      # notifier workers and the ticker thread
    store.on_ingest(service.observe_batch)                          # SeriesStore callback
    collector.register_family_source(service.metric_families)      # or registry.register(service)
    service.alerts()                     # GET /v1/alerts
    service.stop()

``observe`` is cheap and never does I/O: it evaluates the rules and queues
notifications. Every notifier whose payload carries an ``endsAt`` (Alertmanager,
the webhook) gets firing alerts again every ``resend_interval`` with ``endsAt =
now + ends_at_horizon`` (default 4 x ``resend_interval``, as Prometheus does), so
a receiver that honours ``endsAt`` keeps them while the collector lives and
expires them if it dies; Slack and PagerDuty payloads carry no ``endsAt`` and are
sent once per change. A run that ends (its ``run_end`` event) resolves its
alerts; a resolved notice says so, or the value the alert cleared at, and how
long it fired.

Links: ``runbook_url`` is absolute, the collector's own page of the alert's
runbook (``{external_url}/runbooks/{anchor}``, :mod:`trainvitals.alerts.runbooks`)
unless the rule names a URL or ``runbook_base_url`` puts the runbooks elsewhere;
``generatorURL`` is the run's page, ``{external_url}/runs/{run}``. The collector
sets ``external_url`` to where it serves unless the configuration names one.

With ``persistence`` (an :class:`~trainvitals.alerts.persistence.AlertPersistence`;
the collector's state file implements it) alert states, runs and the notifications
delivered survive a restart: :meth:`start` restores them, resends a resolve that
a crash lost (or for a rule that is gone), and pages for a firing alert only
where it was not delivered yet; a still-firing alert does not page again.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import quote

from prometheus_client.core import Metric

from trainvitals.alerts.dispatch import Dispatcher, RetryPolicy
from trainvitals.alerts.engine import DEFAULT_MAX_ALERTS_PER_RULE, Engine
from trainvitals.alerts.loading import RuleSpec, resolve_rules
from trainvitals.alerts.local import format_transition
from trainvitals.alerts.notifiers.base import Notification, Notifier
from trainvitals.alerts.notifiers.config import build_notifiers
from trainvitals.alerts.persistence import AlertPersistence, alert_id
from trainvitals.alerts.runbooks import runbook_url
from trainvitals.alerts.service_views import alert_rows, metric_families
from trainvitals.alerts.state import Alert, AlertState, Transition
from trainvitals.wire.views import BatchView, ReportView

__all__ = ["AlertService"]

log = logging.getLogger("trainvitals.alerts")


class AlertService:
    """Evaluates rules on reports and sends firing/resolved alerts to notifiers."""

    def __init__(
        self,
        engine: Engine,
        notifiers: Sequence[Notifier] = (),
        *,
        resend_interval: float = 60.0,
        ends_at_horizon: float | None = None,
        tick_interval: float = 1.0,
        queue_size: int = 1000,
        retry: RetryPolicy | None = None,
        external_url: str | None = None,
        external_url_default: bool = False,
        runbook_base_url: str | None = None,
        persistence: AlertPersistence | None = None,
    ) -> None:
        if resend_interval <= 0 or tick_interval <= 0:
            raise ValueError("resend_interval and tick_interval must be positive seconds")
        horizon = 4 * resend_interval if ends_at_horizon is None else ends_at_horizon
        if not horizon > resend_interval + tick_interval:
            raise ValueError(
                f"ends_at_horizon ({horizon:g} s) must exceed resend_interval + tick_interval "
                f"({resend_interval + tick_interval:g} s): a receiver would expire a firing alert "
                "between two re-sends"
            )
        self.engine = engine
        self.persistence = persistence
        self.dispatcher = Dispatcher(
            notifiers,
            queue_size=queue_size,
            retry=retry,
            on_delivered=self._delivered if persistence is not None else None,
        )
        self._alerts_dirty = False
        self._resync = False  # a write failed or the file was recreated: save everything
        self._unrecorded: list[tuple[str, list[Notification]]] = []  # deliveries not written yet
        self._restored = False
        self.resend_interval = resend_interval
        self.ends_at_horizon = horizon
        self.tick_interval = tick_interval
        self.external_url = external_url.rstrip("/") if external_url else ""
        # A configured external URL wins over where serve binds (a proxy, a DNS name).
        self._external_url_given = bool(external_url) and not external_url_default
        self.runbook_base_url = runbook_base_url
        self._resends = any(n.wants_repeats for n in notifiers)
        self._last_sent: dict[tuple, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._listeners: list[Callable[[ReportView | None, list[Transition]], None]] = []

    @classmethod
    def from_config(
        cls,
        rules: RuleSpec = "default",
        notifiers: Sequence[Mapping[str, Any]] | None = None,
        *,
        run_ttl: float = 86400.0,
        resolved_retention: float = 900.0,
        max_alerts_per_rule: int = DEFAULT_MAX_ALERTS_PER_RULE,
        **kwargs: Any,
    ) -> AlertService:
        """Build from rules (what :func:`~trainvitals.alerts.loading.resolve_rules` takes:
        ``"default"``, files, folders, rule objects) and ``notifiers:`` dicts.

        Raises :class:`~trainvitals.alerts.loading.RuleError` or
        :class:`~trainvitals.alerts.notifiers.config.NotifierConfigError`.
        Other keyword arguments go to the constructor.
        """
        engine = Engine(
            resolve_rules(rules),
            run_ttl=run_ttl,
            resolved_retention=resolved_retention,
            max_alerts_per_rule=max_alerts_per_rule,
        )
        return cls(engine, build_notifiers(notifiers), **kwargs)

    def serving_at(self, url: str) -> None:
        """Where the collector serves (its base URL): the links' base unless ``external_url``
        was configured (called by ``serve`` once the port is bound)."""
        if not self._external_url_given:
            self.external_url = url.rstrip("/")

    def runbook_url(self, a: Alert) -> str:
        """The absolute runbook link of ``a`` (see the module doc)."""
        return runbook_url(a.rule.runbook, self.external_url, self.runbook_base_url)

    def run_url(self, run: str) -> str:
        """The run's page, ``generatorURL`` (empty without an external URL)."""
        return f"{self.external_url}/runs/{quote(run, safe='/:')}" if self.external_url else ""

    # ------------------------------------------------------------ evaluation

    def observe(self, report: ReportView, now: float | None = None) -> list[Transition]:
        """Evaluate one report and queue its notifications; never blocks on I/O."""
        now = time.time() if now is None else now
        transitions = self.engine.observe(report, now)
        if transitions:
            self._notify(transitions, now)
        for listener in self._listeners:
            self._tell(listener, report, transitions)
        return transitions

    def on_observed(self, listener: Callable[[ReportView | None, list[Transition]], None]) -> None:
        """Call ``listener(report, transitions)`` after each report's evaluation, and
        ``listener(None, transitions)`` for the timers' transitions (the collector's
        pages read the verdicts off this engine instead of evaluating the rules again).
        A failing listener is logged; evaluation and notifications go on."""
        self._listeners.append(listener)

    @staticmethod
    def _tell(listener: Callable[..., None], report: ReportView | None, transitions: list[Transition]) -> None:
        try:
            listener(report, transitions)
        except Exception:
            log.exception("alert listener %r failed; the alerts are unaffected", listener)

    def observe_batch(self, batch: BatchView, now: float | None = None) -> list[Transition]:
        """Every report of a ``POST /v1/reports`` body (the store's ``on_ingest`` signature)."""
        now = time.time() if now is None else now
        out: list[Transition] = []
        for report in batch.reports:
            out.extend(self.observe(report, now))
        return out

    def tick(self, now: float | None = None) -> list[Transition]:
        """Timers (RunSilent, holds, expiry), Alertmanager re-sends, saving state."""
        now = time.time() if now is None else now
        transitions = self.engine.tick(now)
        if transitions:
            self._notify(transitions, now)
            for listener in self._listeners:
                self._tell(listener, None, transitions)
        self.save()
        if self._resends:
            with self._lock:
                due = [
                    a
                    for a in self.engine.firing()
                    if now - self._last_sent.get(a.key, -math.inf) >= self.resend_interval
                ]
                for a in due:
                    self._last_sent[a.key] = now
            for a in due:
                self.dispatcher.enqueue(self._notification(a, now, repeat=True))
        return transitions

    def _notify(self, transitions: list[Transition], now: float) -> None:
        self._alerts_dirty = True
        # Pages first, whatever the disk does: the state write below may fail (full disk).
        self._enqueue_transitions(transitions, now)
        if self.persistence is not None and any(
            t.state in (AlertState.FIRING, AlertState.RESOLVED) for t in transitions
        ):
            self._save_alerts()  # at once: a crash right after a page must not page again

    def _enqueue_transitions(self, transitions: list[Transition], now: float) -> None:
        for t in transitions:
            if t.state is AlertState.FIRING:
                log.info("alert %s", format_transition(t, self.runbook_url(t)))
                with self._lock:
                    self._last_sent[t.key] = now
                self.dispatcher.enqueue(self._notification(t, now))
            elif t.state is AlertState.RESOLVED and t.old is AlertState.FIRING:
                log.info("alert %s", format_transition(t, self.runbook_url(t)))
                with self._lock:
                    self._last_sent.pop(t.key, None)
                self.dispatcher.enqueue(self._notification(t, now))

    def _notification(self, a: Alert, now: float, *, repeat: bool = False) -> Notification:
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

    # ------------------------------------------------------------ persistence

    def save(self) -> None:
        """Write changed runs and, when any changed, the alerts (no-op without persistence).

        A failed write (the persistence logs and counts it) is tried again at the next
        call, in full: every run, the alerts and the deliveries not recorded."""
        if self.persistence is None:
            return
        full = self._resync
        self._resync = False
        try:
            self.persistence.save_runs(self.engine.export_runs(dirty=not full))
        except Exception:  # noqa: BLE001 - any persistence: it logs and counts its own failures
            self._resync = True
        if self._alerts_dirty or full:
            self._save_alerts()
        with self._lock:
            owed, self._unrecorded = self._unrecorded, []
        for notifier, batch in owed:
            self._delivered(notifier, batch)

    def resync(self) -> None:
        """Write everything in full at the next :meth:`save` (the state file was recreated)."""
        self._resync = True
        self._alerts_dirty = True

    def _save_alerts(self) -> None:
        self._alerts_dirty = False
        if self.persistence is None:
            return
        try:
            self.persistence.replace_alerts(self.engine.export_alerts())
        except Exception:  # noqa: BLE001 - any persistence: it logs and counts its own failures
            self._alerts_dirty = True  # logged and counted by the persistence; next tick again

    def _delivered(self, notifier: str, batch: list[Notification]) -> None:
        if self.persistence is None:
            return
        try:
            self.persistence.record_sent(notifier, batch)
        except Exception:  # noqa: BLE001 - any persistence: it logs and counts its own failures
            with self._lock:  # logged and counted by the persistence; recorded at the next save
                if len(self._unrecorded) < 10_000:
                    self._unrecorded.append((notifier, batch))

    def restore(self, now: float | None = None) -> None:
        """Bring back what the persistence holds and reconcile the notifiers with it.

        Called by :meth:`start` (once). For each notifier: an alert it was last told
        is firing that is no longer firing (it resolved, its run expired or its rule
        is gone) gets its resolve; a firing alert it was not told about gets its page.
        """
        if self.persistence is None or self._restored:
            return
        self._restored = True
        now = time.time() if now is None else now
        gone = self.engine.restore(self.persistence.load_runs(), self.persistence.load_alerts())
        for row in gone:
            log.info("alert %s%s: its rule is gone; resolving it downstream", row["alertname"], row["labels"])
        ledger = self.persistence.load_notified()
        current = {alert_id(a.alertname, a.labels): a for a in self.engine.alerts()}
        names = {n.name for n in self.dispatcher.notifiers}
        resolves = pages = 0
        for (notifier, aid), (status, sent) in ledger.items():
            a = current.get(aid)
            if notifier not in names or status != "firing" or (a is not None and a.state is AlertState.FIRING):
                continue
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
            self.dispatcher.enqueue_to(
                notifier,
                Notification(
                    status="resolved",
                    labels=sent["labels"],
                    annotations=annotations,
                    starts_at=sent["starts_at"],
                    ends_at=ended,
                    value=math.nan if value is None else value,
                    generator_url=sent.get("generator_url", ""),
                ),
            )
            resolves += 1
        for aid, a in current.items():
            if a.state is not AlertState.FIRING:
                continue
            for name in names:
                last = ledger.get((name, aid))
                if last is None or last[0] != "firing":
                    self.dispatcher.enqueue_to(name, self._notification(a, now))
                    pages += 1
            with self._lock:
                self._last_sent.setdefault(a.key, now - self.resend_interval)
        log.info(
            "restored %d run(s) and %d alert(s) from the state file; %d resolve(s) and %d page(s) owed to notifiers",
            len(self.engine.export_runs()),
            len(current),
            resolves,
            pages,
        )

    # --------------------------------------------------------------- threads

    def start(self) -> None:
        """Restore persisted state, start the notifier workers and the ticker (every
        ``tick_interval`` s)."""
        self.restore()
        self.dispatcher.start()
        if self._ticker is None:
            self._stop.clear()
            self._ticker = threading.Thread(target=self._tick_loop, name="trainvitals-alert-ticker", daemon=True)
            self._ticker.start()

    def _tick_loop(self) -> None:
        while not self._stop.wait(self.tick_interval):
            try:
                self.tick()
            except Exception:
                log.exception("alert tick failed")

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the ticker; deliver what can be delivered within ``timeout``; close."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout)
            self._ticker = None
        self.dispatcher.stop(timeout)
        if self.persistence is not None:
            self.save()

    def __enter__(self) -> AlertService:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ----------------------------------------------------------------- views

    def alerts(
        self,
        include_pending: bool = True,
        *,
        run: str | None = None,
        states: Iterable[AlertState | str] | None = None,
    ) -> list[dict[str, Any]]:
        """``GET /v1/alerts``: firing, pending and recently resolved alerts, as JSON-ready dicts
        (:func:`trainvitals.alerts.service_views.alert_rows`)."""
        return alert_rows(self, include_pending, run=run, states=states)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per-notifier counters: sent, failed, dropped, retries, queued."""
        return self.dispatcher.stats()

    def metric_families(self) -> Iterator[Metric]:
        """Fresh metric families for the collector's exposition (a prometheus Collector)."""
        return metric_families(self)

    def collect(self) -> Iterator[Metric]:
        """prometheus_client Collector protocol: ``registry.register(service)``."""
        return self.metric_families()
