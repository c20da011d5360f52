"""The dashboards against real data: Debian's Prometheus, configured as
``deploy/prometheus.yml`` ships it (with the exported rules), scrapes a real
collector that a real tiny job (tests/prometheus/_job.py) reports to. Every
variable query of every committed dashboard must list values and every panel
query, variables substituted, must return data; every metric of the catalogue
must reach Prometheus with the labels the catalogue gives it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.http_recorder import RecordingServer
from tests.prometheus import _job
from tests.prometheus._stack import (
    DEPLOY,
    Prometheus,
    load_dashboards,
    panels,
    prometheus_config,
    resolve_variables,
    running_prometheus,
    substitute,
)
from tests.support import needs_tools, one_torch_thread, running_collector, wait_until
from trainvitals.hooks import Monitor
from trainvitals.wire import METRICS, PREFIX

pytestmark = [pytest.mark.integration, needs_tools("prometheus")]

RUN = "it-every-signal"
OPTIONAL_LABELS = {"signal_active": {"reason"}, "token_weight_spread_ratio": {"normalization"}}
STEPS = 12
# Labels Prometheus or the series contract add to a catalogue metric's own labels.
SCRAPE_LABELS = {"__name__", "job", "instance"}
RUN_LABELS = {"run", "rank"}


@dataclass
class Stack:
    prom: Prometheus
    start: float  # unix time before the job's first report
    notified: RecordingServer


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The collector (default rules, a webhook notifier), Prometheus with the shipped
    config and rules, and the job's 12 reported steps, all delivered and scraped."""
    folder = tmp_path_factory.mktemp("prometheus")
    with (
        one_torch_thread(),
        RecordingServer() as notified,
        # A state file, as a deployed collector has by default (its write-error counter too).
        running_collector(
            notifiers=[{"type": "webhook", "url": f"{notified.url}/hook"}], state_path=folder / "state.sqlite3"
        ) as collector,
        running_prometheus(
            folder, prometheus_config(collector.url, rule_files=sorted((DEPLOY / "rules").glob("*.yml")))
        ) as prom,
    ):
        start = time.time() - 1

        def scraped_before_nonfinite(mon: Monitor, step: int) -> None:
            # increase() needs the loss counter scraped once before it moves, at
            # 0; the job is faster than the 1 s scrape, so wait for that scrape.
            if step == _job.NONFINITE_AT:
                assert mon.flush(60), "reports not delivered"
                wait_until(
                    lambda: prom.query(f'{PREFIX}nonfinite_total{{run="{RUN}", what="loss"}} == 0'),
                    60,
                    "the loss counter at 0 in Prometheus",
                )

        _job.run_job(collector.url, RUN, STEPS, before_step=scraped_before_nonfinite)
        wait_until(lambda: prom.query(f'{PREFIX}step{{run="{RUN}"}} == {STEPS}'), 60, "the last step scraped")
        yield Stack(prom, start, notified)


def _empty_panels(prom: Prometheus, start: float, dashboards: list[dict[str, Any]]) -> list[str]:
    """'dashboard / panel: query' for every panel query without data (Grafana runs
    range queries over the time range and instant queries at its end)."""
    empty = []
    end = time.time()
    for dashboard in dashboards:
        values = resolve_variables(prom, dashboard, start)
        for panel in panels(dashboard):
            targets = panel.get("targets") or []
            if not targets:
                empty.append(f"{dashboard['title']} / {panel['title']}: no queries")
            for target in targets:
                expr = substitute(target["expr"], values)
                if target.get("instant"):
                    result = prom.query(expr)
                else:
                    result = prom.query_range(expr, start, end)
                if not result:
                    empty.append(f"{dashboard['title']} / {panel['title']}: {expr}")
    return empty


def test_every_panel_query_returns_data(stack: Stack) -> None:
    last: list[str] = []

    def all_have_data() -> bool:
        last[:] = _empty_panels(stack.prom, stack.start, list(load_dashboards().values()))
        return not last

    # Alert states and rates need a few evaluations after the job's last report.
    try:
        wait_until(all_have_data, 60, interval=1.0)
    except AssertionError:
        pytest.fail("panels without data:\n  " + "\n  ".join(last))


def _per_run(name: str) -> bool:
    """Series of a run carry run (and rank): the hooks' metrics and the collector's
    per-run ones (group "run": step, last report time, run ended)."""
    spec = METRICS[name]
    return spec.owner == "hooks" or spec.group == "run"


def test_every_catalogue_metric_reaches_prometheus(stack: Stack) -> None:
    missing = [PREFIX + name for name in METRICS if not stack.prom.series(PREFIX + name, stack.start)]
    assert not missing, f"catalogue metrics the job and collector never produced: {missing}"
    for name in METRICS:
        if _per_run(name):
            series = stack.prom.series(PREFIX + name, stack.start)
            assert all(s.get("run") == RUN for s in series), f"{PREFIX}{name}: {series}"


def test_series_carry_the_catalogues_labels(stack: Stack) -> None:
    """Each series has only the labels the catalogue gives its metric (plus run/rank
    and the scrape's job/instance), and each catalogue label occurs."""
    problems = []
    for spec in METRICS.values():
        series = stack.prom.series(PREFIX + spec.name, stack.start)
        allowed = SCRAPE_LABELS | set(spec.labels) | (RUN_LABELS if _per_run(spec.name) else set())
        seen = {label for s in series for label in s}
        if seen - allowed:
            problems.append(
                f"{PREFIX}{spec.name}: labels {sorted(seen - allowed)} not in the catalogue (labels={spec.labels})"
            )
        # signal_active carries ``reason`` only while a signal is inactive, and this job
        # watches everything (tests/hooks/test_coverage.py reads the reasons off /metrics).
        expected = set(spec.labels) - OPTIONAL_LABELS.get(spec.name, set())
        if series and expected - seen:
            problems.append(f"{PREFIX}{spec.name}: catalogue labels {sorted(expected - seen)} on no series")
    assert not problems, "\n".join(problems)


def test_the_collector_notified_through_its_webhook(stack: Stack) -> None:
    """The notifier behind notifications_total really delivered (the job pages
    NonFiniteLoss): the collector-owned series are not just zeros."""
    wait_until(lambda: stack.notified.received(), 60, "a webhook notification")
    bodies = [r.json() for r in stack.notified.received()]
    names = {a["labels"]["alertname"] for b in bodies for a in b["alerts"] if a["status"] == "firing"}
    assert "NonFiniteLoss" in names, bodies


def test_variables_see_the_jobs_labels(stack: Stack) -> None:
    """The variable queries list what the job reported, not just something."""
    seen: dict[str, set[str]] = {}
    for dashboard in load_dashboards().values():
        for name, values in resolve_variables(stack.prom, dashboard, stack.start).items():
            seen.setdefault(name, set()).update(values)
    assert seen["run"] == {RUN}
    assert seen["modality"] == {"text", "image"}
    assert seen["task"] == {"lm", "ie"}
    assert seen["param"] == {"scale", "norm.weight", "head.bias"}


def test_an_empty_panel_fails_with_its_title(stack: Stack) -> None:
    """The check itself: a panel whose query matches nothing is reported by title."""
    dashboard = {
        "title": "probe",
        "templating": {"list": []},
        "panels": [
            {
                "type": "row",
                "title": "a row",
                "panels": [
                    {
                        "type": "timeseries",
                        "title": "Nothing here",
                        "targets": [{"expr": f"{PREFIX}no_such_metric", "refId": "A"}],
                    }
                ],
            },
            {"type": "stat", "title": "Steps", "targets": [{"expr": f"{PREFIX}step", "instant": True, "refId": "A"}]},
            {"type": "stat", "title": "No targets"},
        ],
    }
    empty = _empty_panels(stack.prom, stack.start, [dashboard])
    assert empty == [f"probe / Nothing here: {PREFIX}no_such_metric", "probe / No targets: no queries"]
