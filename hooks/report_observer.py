"""What the job itself makes of its reports, on the sender thread: the alert rules
evaluated in the job (``attach(rules=...)``, no collector needed) and the latest
report's headline figures for the trackers (:mod:`trainvitals.hooks.headline`)."""

from __future__ import annotations

from typing import Any

from trainvitals.hooks.headline import headline_figures

__all__ = ["ReportObserver"]

_DROPPED = "client_dropped_reports_total"  # the sender's own counter, on every report


class ReportObserver:
    """Sees each report the sender makes (:meth:`observe`); ``rules``: the rules to
    evaluate in the job, or None (a collector evaluates them)."""

    def __init__(self, rules: Any = None) -> None:
        self.evaluator: Any = None
        """The in-job rules' evaluator (:class:`trainvitals.alerts.LocalEvaluator`), or None."""
        if rules is not None:
            from trainvitals.alerts import LocalEvaluator  # the alerts package, only when asked

            self.evaluator = LocalEvaluator(rules=rules)
        # The latest report's step, samples and firing alerts (set by the sender thread);
        # its headline figures are worked out when a tracker asks (most jobs have none),
        # and kept with the report they came from.
        self._headline_of: tuple[int, Any, list[str]] | None = None
        self._headline: tuple[tuple[int, Any, list[str]], tuple[int, dict[str, float]]] | None = None

    def observe(self, report: Any) -> None:
        """Sender thread: the in-process rules, then the headline figures for the trackers."""
        if self.evaluator is not None:
            self.evaluator.observe(report)
        # The sender adds its drop counter to every report; a report with nothing else (the
        # run's end sent at close) has no figures and must not replace the last step's.
        if any(s.name != _DROPPED for s in report.samples):
            self._headline_of = (report.step, report.samples, self.firing_names())

    def firing_names(self) -> list[str]:
        """The alerts the in-job rules see firing now."""
        return [a.alertname for a in self.evaluator.firing()] if self.evaluator is not None else []

    def headline(self) -> tuple[int, dict[str, float]] | None:
        """The latest report's step and headline figures; None before the first report."""
        source = self._headline_of
        if source is None:
            return None
        kept = self._headline
        if kept is not None and kept[0] is source:
            return kept[1]
        figures = (source[0], headline_figures(source[1], source[2]))
        self._headline = (source, figures)
        return figures

    def verdict(self, run: str) -> Any:
        """The in-job rules' verdict on ``run`` so far, or None without in-job rules."""
        return self.evaluator.verdict(run) if self.evaluator is not None else None

    def close(self, run: str, report_file: str | None) -> None:
        """At the run's end: the in-job rules' verdict, logged (nothing without rules)."""
        if self.evaluator is not None:
            self.evaluator.close(run, report_file=report_file)
