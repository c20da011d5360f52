"""Alert rules, their evaluation engine, notifiers, and the collector's alert service.

In the collector::

    from trainvitals.alerts import AlertService
    service = AlertService.from_config(rules="default", notifiers=[...])

In the training process (no collector, no HTTP)::

    from trainvitals.alerts import LocalEvaluator
    evaluate = LocalEvaluator(rules="default")
    evaluate(report)   # logs a warning on "trainvitals" when an alert fires

Modules, one concept each (the rule format is in ``docs/rules.md``):

- ``model``: the rule model (Matcher, Condition, ThresholdRule, EventRule,
  SilenceRule, durations, the labels a metric's series carry);
- ``templates``: checking summary/description templates at load, rendering them;
- ``loading``: rule files and folders, ``"default"``, unique names, RuleError;
  ``resolve_rules`` turns every accepted rule spec into rule objects;
- ``state``: AlertState and the Alert/Transition snapshots;
- ``transforms``: the ``increase``/``ratio_to_median`` value transforms;
- ``conditions``: what ``and`` conditions read (another metric's latest series);
- ``engine``: the state machines over reports and timers, on rule objects only (no
  I/O); ``rule_index``: the rules compiled and indexed for it; ``transitions``: one
  alert's moves (pending, firing, resolved); ``instances``: the state record of one
  alert and one run; ``alert_table``: the alerts held, bounded per rule and run;
  ``engine_state``: their export and restore across a restart;
- ``verdict``: a run's incidents from the engine's transitions; ``verdict_text``: the
  verdict as log lines and a table (recorded reports are read by
  :mod:`trainvitals.wire.report_files`);
- ``local``: LocalEvaluator (in-process, logs); ``service``: AlertService (collector:
  evaluation, wiring); ``notifications``: an alert as a notification, with its links;
  ``state_writer``: saving the service's state as it changes; ``reconcile``: the
  notifiers told what they missed after a restart; ``ticker``: the timer thread;
  ``service_views``: the ``/v1/alerts`` rows and Prometheus families;
  ``persistence``: what the service asks of a state store (the collector implements
  it; this package never imports the collector);
- ``dispatch`` and ``notifiers``: sending; ``runbooks``: the runbook pages;
  ``export``: the Prometheus rule file; ``cli``: ``trainvitals rules check|export``.

Attributes load lazily: the rule model and engine need only pydantic and
PyYAML; the service and notifiers bring httpx and prometheus_client. No torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "Alert",
    "AlertService",
    "AlertState",
    "Condition",
    "Dispatcher",
    "Engine",
    "EventRule",
    "LocalEvaluator",
    "Notification",
    "Notifier",
    "NotifierConfigError",
    "NotifyError",
    "RetryPolicy",
    "Rule",
    "RuleError",
    "SilenceRule",
    "ThresholdRule",
    "Transition",
    "build_notifiers",
    "export_prometheus",
    "load_rules",
    "resolve_rules",
]

_WHERE = {
    "Alert": "state",
    "AlertState": "state",
    "Transition": "state",
    "Engine": "engine",
    "Condition": "model",
    "EventRule": "model",
    "Rule": "model",
    "SilenceRule": "model",
    "ThresholdRule": "model",
    "RuleError": "loading",
    "load_rules": "loading",
    "resolve_rules": "loading",
    "LocalEvaluator": "local",
    "AlertService": "service",
    "Dispatcher": "dispatch",
    "RetryPolicy": "dispatch",
    "Notification": "notifiers.base",
    "Notifier": "notifiers.base",
    "NotifyError": "notifiers.base",
    "NotifierConfigError": "notifiers.config",
    "build_notifiers": "notifiers.config",
    "export_prometheus": "export",
}

if TYPE_CHECKING:  # pragma: no cover
    from trainvitals.alerts.dispatch import Dispatcher, RetryPolicy
    from trainvitals.alerts.engine import Engine
    from trainvitals.alerts.export import export_prometheus
    from trainvitals.alerts.loading import RuleError, load_rules, resolve_rules
    from trainvitals.alerts.local import LocalEvaluator
    from trainvitals.alerts.model import Condition, EventRule, Rule, SilenceRule, ThresholdRule
    from trainvitals.alerts.notifiers.base import Notification, Notifier, NotifyError
    from trainvitals.alerts.notifiers.config import NotifierConfigError, build_notifiers
    from trainvitals.alerts.service import AlertService
    from trainvitals.alerts.state import Alert, AlertState, Transition


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'trainvitals.alerts' has no attribute {name!r}")
    return getattr(importlib.import_module(f"trainvitals.alerts.{module}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)
