"""Rules evaluated inside the training process, without a collector.

The hooks call a :class:`LocalEvaluator` with each report (``attach(...,
rules="default")``): an alert that fires is logged as a warning on the
``trainvitals`` logger, a resolution as info. Nothing is sent anywhere.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from trainvitals.alerts.engine import Engine
from trainvitals.alerts.loading import RuleSpec, resolve_rules
from trainvitals.alerts.model import SilenceRule
from trainvitals.alerts.state import Alert, AlertState, Transition
from trainvitals.wire import Report

__all__ = ["LocalEvaluator", "format_transition"]


def format_transition(t: Transition) -> str:
    """One log line: ``GradientDilution firing: <summary> {run=..., ...} runbook: ...``."""
    labels = ", ".join(f"{k}={v}" for k, v in t.labels.items())
    text = f"{t.alertname} {t.state.value}: {t.summary} {{{labels}}}"
    if t.reason:
        text += f" ({t.reason})"
    if t.state is AlertState.FIRING and t.rule.runbook:
        text += f" runbook: {t.rule.runbook}"
    return text


class LocalEvaluator:
    """Evaluate rules on each report in-process and log what fires and resolves.

    ``rules``: what :func:`~trainvitals.alerts.loading.resolve_rules` takes
    (``"default"``, rule files and folders, rule objects). RunSilent rules
    are left out (a process that reports is not silent). Call it with each report
    (``evaluator(report)``); it never raises into the caller.
    """

    def __init__(
        self,
        rules: RuleSpec = "default",
        *,
        logger: logging.Logger | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.engine = Engine([r for r in resolve_rules(rules) if not isinstance(r, SilenceRule)])
        self.log = logger or logging.getLogger("trainvitals")
        self.clock = clock

    def __call__(self, report: Report | Mapping[str, Any]) -> list[Transition]:
        return self.observe(report)

    def observe(self, report: Report | Mapping[str, Any], now: float | None = None) -> list[Transition]:
        """Evaluate one report (a wire Report or its dict form); log and return the transitions."""
        now = self.clock() if now is None else now
        try:
            if not isinstance(report, Report):
                report = Report.model_validate(report)
            transitions = self.engine.observe(report, now)
            transitions.extend(self.engine.tick(now))
        except Exception:  # never into the training loop
            self.log.exception("trainvitals: rule evaluation failed")
            return []
        for t in transitions:
            if t.state is AlertState.FIRING:
                self.log.warning("trainvitals alert %s", format_transition(t))
            elif t.state is AlertState.RESOLVED:
                self.log.info("trainvitals alert %s", format_transition(t))
        return transitions

    def firing(self) -> list[Alert]:
        """Alerts firing now."""
        return self.engine.firing()
