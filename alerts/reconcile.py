"""After a restart: the engine's state back, and the notifiers told what they missed.

:func:`reconcile` restores the runs and alerts an
:class:`~trainvitals.alerts.persistence.AlertPersistence` kept into the engine, then
compares, notifier by notifier, the ledger of what each was last told
(``load_notified``) with the alerts now: an alert a notifier was last told is firing
that is no longer firing (it resolved, its run expired or its rule is gone) gets its
resolve; a firing alert it was not told about gets its page; a firing alert it was
told about is not paged again. Writing the state as it changes is
:mod:`trainvitals.alerts.state_writer`'s.
"""

from __future__ import annotations

import logging

from trainvitals.alerts.dispatch import Dispatcher
from trainvitals.alerts.engine import Engine
from trainvitals.alerts.notifications import NotificationBuilder
from trainvitals.alerts.persistence import AlertPersistence, alert_id
from trainvitals.alerts.state import Alert, AlertState

__all__ = ["reconcile"]

log = logging.getLogger("trainvitals.alerts")


def reconcile(
    engine: Engine,
    persistence: AlertPersistence,
    dispatcher: Dispatcher,
    notifications: NotificationBuilder,
    now: float,
) -> list[Alert]:
    """Restore ``engine`` from ``persistence`` and queue on ``dispatcher`` the resolves and
    pages its notifiers are owed; return the alerts firing now (whose re-sends the caller
    schedules)."""
    gone = engine.restore(persistence.load_runs(), persistence.load_alerts())
    for row in gone:
        log.info("alert %s%s: its rule is gone; resolving it downstream", row["alertname"], row["labels"])
    ledger = persistence.load_notified()
    current = {alert_id(a.alertname, a.labels): a for a in engine.alerts()}
    names = {n.name for n in dispatcher.notifiers}
    resolves = pages = 0
    for (notifier, aid), (status, sent) in ledger.items():
        a = current.get(aid)
        if notifier not in names or status != "firing" or (a is not None and a.state is AlertState.FIRING):
            continue
        dispatcher.enqueue_to(notifier, notifications.resolve_of(sent, a, now))
        resolves += 1
    firing = []
    for aid, a in current.items():
        if a.state is not AlertState.FIRING:
            continue
        for name in names:
            last = ledger.get((name, aid))
            if last is None or last[0] != "firing":
                dispatcher.enqueue_to(name, notifications.notification(a, now))
                pages += 1
        firing.append(a)
    log.info(
        "restored %d run(s) and %d alert(s) from the state file; %d resolve(s) and %d page(s) owed to notifiers",
        len(engine.export_runs()),
        len(current),
        resolves,
        pages,
    )
    return firing
