"""The collector's pages read their verdicts off the alert service's engine: the rules
are evaluated once per report, and the verdict is the one a separate evaluation gives."""

from __future__ import annotations

from tests.reports import wire_report
from trainvitals.alerts.service import AlertService
from trainvitals.alerts.verdict import VerdictBuilder
from trainvitals.monitor.routes_pages import LivePages
from trainvitals.wire import ReportBatch

DILUTED = ("modality_excess_dilution_ratio", {"modality": "image"}, 17.0)


def _reports() -> list:
    """A run diluted from step 10 to 40 (GradientDilution, for_steps 20), then healed."""
    out = []
    for step in range(1, 61):
        value = 17.0 if 10 <= step <= 40 else 1.0
        out.append(wire_report(step, [(DILUTED[0], DILUTED[1], value), ("grad_norm", {}, 1.0)]))
    return out


def test_pages_verdict_equals_a_separate_evaluation_and_skips_run_silent():
    service = AlertService.from_config("default")
    pages = LivePages(alerts=service)
    service.on_observed(pages.observed)
    alone = VerdictBuilder("default")
    assert pages.builder.engine is service.engine  # one evaluation per report
    for report in _reports():
        service.observe_batch(ReportBatch(schema_version=1, reports=[report]), report.time)
        alone.observe(report, report.time)
    shared = pages.builder.verdict("r1").as_dict()
    assert shared == alone.verdict("r1").as_dict()
    assert [i["alert"] for i in shared["incidents"]] == ["GradientDilution"]
    assert shared["incidents"][0]["resolved"] is True
    # The run then goes silent: the collector pages that (RunSilent), the report page's
    # verdict is about what the run reported and leaves it out.
    later = service.tick(1000 + 60 + 3600.0)
    assert [t.alertname for t in later] == ["RunSilent"]
    assert pages.builder.verdict("r1").as_dict() == shared
    # Forgetting the run on the pages (their bound) leaves the alerts' state alone.
    pages.builder.forget("r1", 0.0)
    assert pages.builder.verdict("r1").incidents == []
