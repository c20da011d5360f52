"""The collector's pages read their verdicts off the alert service's engine: the rules
are evaluated once per report, and the verdict is the one a separate evaluation gives;
``/`` and ``/v1/alerts`` say what the job's own evaluation says."""

from __future__ import annotations

import html
import logging
import re

import pytest

from tests.e2e._jobs import DilutionJob
from tests.reports import wire_report
from tests.support import one_torch_thread, running_collector, wait_until
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


def test_the_collector_says_the_step_an_alert_resolved_at_and_lists_past_incidents(caplog):
    """A real job reporting to a real collector, its rules also evaluated in the job: the
    collector's resolved alert names the step the job's own log names (the report that
    cleared it, not the latest one), and ``/`` lists the incidents of a run that ended."""
    healed, stuck = DilutionJob(), DilutionJob(seed=1)
    with one_torch_thread(), running_collector() as c, caplog.at_level(logging.INFO, logger="trainvitals"):
        mon = healed.attach(c.url, "healed", rules="default")
        healed.train(mon, 25)  # steps 1-25 diluted: pending at 1, fires at 1 + for_steps = 21
        healed.fixed = True
        healed.train(mon, 20)  # steps 26-45 healthy: the report of step 26 clears it
        assert mon.flush(30)
        job_log = [r.getMessage() for r in caplog.records if r.name == "trainvitals"]
        logged = [m[m.index("Resolved: ") :] for m in job_log if "Resolved: GradientDilution" in m]
        assert len(logged) == 1 and " at step 26: " in logged[0], job_log
        (alert,) = c.alerts("healed")
        assert alert["state"] == "resolved" and alert["step"] == 26
        # The same words up to how long it fired (each side's own clock).
        assert alert["summary"].split(" after firing")[0] == logged[0].split(" after firing")[0]
        assert alert["value"] == pytest.approx(1.0, abs=0.05)  # the value that cleared it
        mon.close()
        # A second run ends while the alert still fires: the run's end resolves it.
        with stuck.attach(c.url, "stuck", rules="default") as mon2:
            stuck.train(mon2, 23)
            assert mon2.flush(30)
        wait_until(lambda: len(c.client.get("/").text.split('class="run"')) == 3, 60, "both runs on /")
        wait_until(lambda: "ended" in _rows(c)["stuck"], 60, "the stuck run's end")
        rows = _rows(c)
    assert rows["healed"] == "healed|45|ended|resolved: GradientDilution (modality=image, steps 21-26)"
    assert rows["stuck"] == "stuck|23|ended|firing when the run ended: GradientDilution (modality=image, steps 21-23)"


def _rows(c) -> dict[str, str]:
    """``/``'s table, a row per run: its cells' text joined by ``|``."""
    page = c.client.get("/").text
    out = {}
    for row in re.findall(r'<tr class="run".*?</tr>', page):
        cells = [html.unescape(re.sub(r"<[^>]+>", "", cell)) for cell in re.findall(r"<td[^>]*>(.*?)</td>", row)]
        out[cells[0]] = "|".join(cells)
    return out
