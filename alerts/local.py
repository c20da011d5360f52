"""Rules evaluated inside the training process, without a collector.

The hooks call a :class:`LocalEvaluator` with each report (``attach()`` does with
the default rules when no collector is configured, or with ``rules=...``): each
alert that fires is one warning on the ``trainvitals`` logger, each resolution one
info line, both with the step and the value. At close, :meth:`LocalEvaluator.close`
logs the run's verdict (:mod:`trainvitals.alerts.verdict`): every incident with its
first and last step, peak value and what to do, or "no incident in N reports".
Nothing is sent anywhere.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from trainvitals.alerts.loading import RuleSpec
from trainvitals.alerts.state import Alert, AlertState, Transition
from trainvitals.alerts.verdict import RunVerdict, VerdictBuilder
from trainvitals.alerts.verdict_text import format_transition, format_verdict
from trainvitals.wire import Report

__all__ = ["LocalEvaluator", "format_transition"]


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
        self.verdicts = VerdictBuilder(rules)
        self.engine = self.verdicts.engine
        self.log = logger or logging.getLogger("trainvitals")
        self.clock = clock
        self._lock = threading.Lock()

    def __call__(self, report: Report | Mapping[str, Any]) -> list[Transition]:
        return self.observe(report)

    def observe(self, report: Report | Mapping[str, Any], now: float | None = None) -> list[Transition]:
        """Evaluate one report (a wire Report or its dict form); log and return the transitions."""
        now = self.clock() if now is None else now
        try:
            if not isinstance(report, Report):
                report = Report.model_validate(report)
            with self._lock:
                transitions = self.verdicts.observe(report, now)
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

    def verdict(self, run: str) -> RunVerdict:
        """The verdict on ``run`` so far."""
        with self._lock:
            return self.verdicts.verdict(run)

    def close(self, run: str, *, report_file: str | None = None) -> RunVerdict | None:
        """Log the verdict on ``run`` (a warning when an incident was seen); never raises."""
        try:
            verdict = self.verdict(run)
            lines = format_verdict(verdict, report_file=report_file)
            self.log.log(logging.WARNING if verdict.incidents else logging.INFO, "%s", "\n".join(lines))
            return verdict
        except Exception:
            self.log.exception("trainvitals: could not compute the verdict")
            return None
