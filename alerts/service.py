"""The collector's alerting: engine + notifiers + timers, behind one object.

::

    service = AlertService.from_config(rules="default", notifiers=cfg.notifiers)
    service.start()                      # notifier workers and the ticker thread
    store.on_ingest(service.observe_batch)                          # SeriesStore callback
    collector.register_family_source(service.metric_families)      # or registry.register(service)
    service.alerts()                     # GET /v1/alerts
    service.stop()

``observe`` is cheap and never does I/O: it evaluates the rules
(:mod:`trainvitals.alerts.engine`) and queues notifications
(:mod:`trainvitals.alerts.notifications` builds them, :mod:`trainvitals.alerts.dispatch`
sends them). Every notifier whose payload carries an ``endsAt`` (Alertmanager, the
webhook) gets firing alerts again every ``resend_interval`` with ``endsAt = now +
ends_at_horizon`` (default 4 x ``resend_interval``, as Prometheus does), so a receiver
that honours ``endsAt`` keeps them while the collector lives and expires them if it
dies; Slack and PagerDuty payloads carry no ``endsAt`` and are sent once per change. A
run that ends (its ``run_end`` event) resolves its alerts; a resolved notice says so,
or the value the alert cleared at, and how long it fired. The timers run on a thread
of their own (:mod:`trainvitals.alerts.ticker`).

With ``persistence`` (an :class:`~trainvitals.alerts.persistence.AlertPersistence`;
the collector's state file implements it) alert states, runs and the notifications
delivered survive a restart: they are written as they change
(:mod:`trainvitals.alerts.state_writer`), and :meth:`start` restores them, resends a
resolve that a crash lost (or for a rule that is gone), and pages for a firing alert
only where it was not delivered yet (:mod:`trainvitals.alerts.reconcile`); a
still-firing alert does not page again. What the service shows (the ``/v1/alerts``
rows, its Prometheus families) is :mod:`trainvitals.alerts.service_views`'.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client.core import Metric

from trainvitals.alerts.dispatch import Dispatcher, RetryPolicy
from trainvitals.alerts.engine import DEFAULT_MAX_ALERTS_PER_RULE, Engine
from trainvitals.alerts.loading import RuleSpec, resolve_rules
from trainvitals.alerts.notifications import NotificationBuilder
from trainvitals.alerts.notifiers.base import Notifier
from trainvitals.alerts.notifiers.config import build_notifiers
from trainvitals.alerts.persistence import AlertPersistence
from trainvitals.alerts.reconcile import reconcile
from trainvitals.alerts.service_views import alert_rows, metric_families
from trainvitals.alerts.state import Alert, AlertState, Transition
from trainvitals.alerts.state_writer import StateWriter
from trainvitals.alerts.ticker import Ticker
from trainvitals.alerts.verdict_text import format_transition
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
        self._writer = StateWriter(engine, persistence) if persistence is not None else None
        self.dispatcher = Dispatcher(
            notifiers,
            queue_size=queue_size,
            retry=retry,
            on_delivered=self._writer.delivered if self._writer is not None else None,
        )
        self._restored = False
        self.resend_interval = resend_interval
        self.tick_interval = tick_interval
        self.notifications = NotificationBuilder(
            horizon,
            external_url=external_url,
            external_url_default=external_url_default,
            runbook_base_url=runbook_base_url,
        )
        self._resends = any(n.wants_repeats for n in notifiers)
        self._last_sent: dict[tuple[Any, ...], float] = {}
        self._lock = threading.Lock()
        self._ticker = Ticker(self.tick, tick_interval)
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

    # ----------------------------------------------------------------- links

    @property
    def external_url(self) -> str:
        """The base of the links notifications carry (no trailing slash; empty: none)."""
        return self.notifications.external_url

    @property
    def ends_at_horizon(self) -> float:
        """Seconds ahead of now a firing notification's ``endsAt`` lies."""
        return self.notifications.ends_at_horizon

    @property
    def runbook_base_url(self) -> str | None:
        return self.notifications.runbook_base_url

    def serving_at(self, url: str) -> None:
        """Where the collector serves (its base URL): the links' base unless ``external_url``
        was configured (called by ``serve`` once the port is bound)."""
        self.notifications.serving_at(url)

    def runbook_url(self, a: Alert) -> str:
        """The absolute runbook link of ``a`` (:mod:`trainvitals.alerts.notifications`)."""
        return self.notifications.runbook_url(a)

    def run_url(self, run: str) -> str:
        """The run's page, ``generatorURL`` (empty without an external URL)."""
        return self.notifications.run_url(run)

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
                self.dispatcher.enqueue(self.notifications.notification(a, now, repeat=True))
        return transitions

    def _notify(self, transitions: list[Transition], now: float) -> None:
        writer = self._writer
        if writer is not None:
            writer.alerts_changed()
        # Pages first, whatever the disk does: the state write below may fail (full disk).
        self._enqueue_transitions(transitions, now)
        if writer is not None and any(t.state in (AlertState.FIRING, AlertState.RESOLVED) for t in transitions):
            writer.save_alerts()  # at once: a crash right after a page must not page again

    def _enqueue_transitions(self, transitions: list[Transition], now: float) -> None:
        for t in transitions:
            if t.state is AlertState.FIRING:
                log.info("alert %s", format_transition(t, self.runbook_url(t)))
                with self._lock:
                    self._last_sent[t.key] = now
                self.dispatcher.enqueue(self.notifications.notification(t, now))
            elif t.state is AlertState.RESOLVED and t.old is AlertState.FIRING:
                log.info("alert %s", format_transition(t, self.runbook_url(t)))
                with self._lock:
                    self._last_sent.pop(t.key, None)
                self.dispatcher.enqueue(self.notifications.notification(t, now))

    # ------------------------------------------------------------ persistence

    def save(self) -> None:
        """Write changed runs and, when any changed, the alerts (no-op without persistence;
        :mod:`trainvitals.alerts.state_writer`). A failed write is tried again at the next
        call, in full: every run, the alerts and the deliveries not recorded."""
        if self._writer is not None:
            self._writer.save()

    def resync(self) -> None:
        """Write everything in full at the next :meth:`save` (the state file was recreated)."""
        if self._writer is not None:
            self._writer.resync()

    def restore(self, now: float | None = None) -> None:
        """Bring back what the persistence holds and reconcile the notifiers with it
        (:func:`trainvitals.alerts.reconcile.reconcile`).

        Called by :meth:`start` (once). For each notifier: an alert it was last told
        is firing that is no longer firing (it resolved, its run expired or its rule
        is gone) gets its resolve; a firing alert it was not told about gets its page.
        """
        if self.persistence is None or self._restored:
            return
        self._restored = True
        now = time.time() if now is None else now
        firing = reconcile(self.engine, self.persistence, self.dispatcher, self.notifications, now)
        with self._lock:  # still firing: re-sent at the next tick, not paged again
            for a in firing:
                self._last_sent.setdefault(a.key, now - self.resend_interval)

    # --------------------------------------------------------------- threads

    def start(self) -> None:
        """Restore persisted state, start the notifier workers and the ticker (every
        ``tick_interval`` s)."""
        self.restore()
        self.dispatcher.start()
        self._ticker.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the ticker; deliver what can be delivered within ``timeout``; close."""
        self._ticker.stop(timeout)
        self.dispatcher.stop(timeout)
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
