"""Exposition: StoreCollector.render() (what /metrics serves), read back with
prometheus_client's parser and checked with promtool."""

from __future__ import annotations

import logging
import math
import subprocess
import time

import pytest
from prometheus_client.metrics_core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from tests.reports import make_batch, make_report, make_sample
from tests.support import Series, metric_value, needs_tools, parse_metrics, require_tool
from trainvitals.monitor.exposition import REPORT_OUTCOMES, ReportCounter, StoreCollector
from trainvitals.monitor.store import SeriesStore
from trainvitals.wire import METRICS

RUN_END = {"kind": "run_end", "detail": "Monitor.close() after 1 optimizer steps"}


def ingest(store: SeriesStore, *reports: dict, now: float | None = None) -> None:
    store.ingest(make_batch(*reports), now)


def scrape(exporter: StoreCollector) -> dict[Series, float]:
    """Every sample of one render, parsed: (sample name, label items) -> value."""
    return parse_metrics(exporter.render().decode())


def value(exporter: StoreCollector, name: str, **labels: str) -> float | None:
    return metric_value(exporter.render().decode(), name, **labels)


@pytest.fixture
def store() -> SeriesStore:
    return SeriesStore()


@pytest.fixture
def exporter(store: SeriesStore) -> StoreCollector:
    return StoreCollector(store)


def test_store_series_appear_with_run_label_and_per_run_series(store, exporter):
    now = time.time()
    ingest(
        store,
        make_report("mm-pt1", 120, [make_sample("modality_grad_share_ratio", 0.0094, modality="image")]),
        make_report("mm-pt1", 120, [make_sample("grad_norm", 2.0)], rank=3),
        make_report("mm-pt1", 120, [make_sample("grad_norm", 1.0)]),
        now=now,
    )
    got = scrape(exporter)
    assert (
        got[("trainvitals_modality_grad_share_ratio", frozenset({"run": "mm-pt1", "modality": "image"}.items()))]
        == 0.0094
    )
    # Rank 0 speaks for the run (no rank label); other ranks are labelled.
    assert got[("trainvitals_grad_norm", frozenset({"run": "mm-pt1", "rank": "3"}.items()))] == 2.0
    assert got[("trainvitals_grad_norm", frozenset({"run": "mm-pt1"}.items()))] == 1.0
    assert value(exporter, "trainvitals_step", run="mm-pt1") == 120
    assert value(exporter, "trainvitals_last_report_timestamp_seconds", run="mm-pt1") == now
    assert value(exporter, "trainvitals_run_ended", run="mm-pt1") is None


def test_run_ended_is_exposed_while_the_last_report_says_so(store, exporter):
    ingest(store, make_report("done", 9, events=[RUN_END]), make_report("going", 9))
    assert value(exporter, "trainvitals_run_ended", run="done") == 1
    assert value(exporter, "trainvitals_run_ended", run="going") is None
    assert value(exporter, "trainvitals_collector_series") == len(store) == 7

    ingest(store, make_report("done", 10))  # the run resumed: the marker goes
    text = exporter.render().decode()
    assert "trainvitals_run_ended{" not in text
    assert "# TYPE trainvitals_run_ended gauge" in text


def test_counters_are_exposed_with_total_suffix_and_no_created(store, exporter):
    ingest(store, make_report("a", 1, [make_sample("optimizer_state_resets_total", 2.0)]))
    assert value(exporter, "trainvitals_optimizer_state_resets_total", run="a") == 2.0
    text = exporter.render().decode()
    assert "# TYPE trainvitals_optimizer_state_resets_total counter" in text
    assert "_created" not in text


def test_help_and_type_come_from_the_wire_table(store, exporter):
    ingest(
        store,
        make_report("a", 1, [make_sample("loss", 1.0), make_sample("brand_new", 1.0)], events=[RUN_END]),
    )
    families = {f.name: f for f in text_string_to_metric_families(exporter.render().decode())}
    own = ["step", "last_report_timestamp_seconds", "run_ended", "collector_reports", "collector_series"]
    for name in [*own, "loss"]:
        spec = METRICS.get(name) or METRICS[name + "_total"]
        family = families["trainvitals_" + name]
        assert (family.documentation, family.type) == (spec.help, spec.type), name
    assert families["trainvitals_brand_new"].documentation.startswith("Sent by a trainvitals client")


def test_expired_runs_vanish_from_the_scrape():
    store = SeriesStore(ttl_seconds=0.001)
    ingest(store, make_report("a", 1), now=1.0)
    assert "run=" not in StoreCollector(store).render().decode()


def test_report_outcomes_are_all_present_from_the_start(store):
    reports = ReportCounter()
    exporter = StoreCollector(store, reports)
    for outcome in REPORT_OUTCOMES:
        assert value(exporter, "trainvitals_collector_reports_total", outcome=outcome) == 0
    reports.inc("accepted", 5)
    reports.inc("bad_gzip")
    assert value(exporter, "trainvitals_collector_reports_total", outcome="accepted") == 5
    assert value(exporter, "trainvitals_collector_reports_total", outcome="bad_gzip") == 1
    with pytest.raises(ValueError, match="unknown outcome"):
        reports.inc("meh")


def test_family_sources_extend_the_scrape_and_can_be_removed(exporter, caplog):
    def alerts():
        fam = GaugeMetricFamily("trainvitals_alerts_firing", "Alerts firing now.", labels=["alertname", "severity"])
        fam.add_metric(["GradientDilution", "page"], 1)
        return [fam]

    def broken():
        raise RuntimeError("boom")

    handle = exporter.register_family_source(alerts)
    exporter.register_family_source(broken)
    labels = {"alertname": "GradientDilution", "severity": "page"}
    with caplog.at_level(logging.ERROR, logger="trainvitals.monitor.exposition"):
        assert value(exporter, "trainvitals_alerts_firing", **labels) == 1
    assert "family source" in caplog.text

    handle.remove()
    handle.remove()
    assert value(exporter, "trainvitals_alerts_firing", **labels) is None


def test_nan_and_inf_render(store, exporter):
    ingest(
        store,
        make_report(
            "a", 1, [make_sample("grad_norm", math.nan), make_sample("modality_loss", -math.inf, modality="x")]
        ),
    )
    text = exporter.render().decode()
    assert 'trainvitals_grad_norm{run="a"} NaN' in text
    assert 'trainvitals_modality_loss{modality="x",run="a"} -Inf' in text


def test_render_parses_back_to_exactly_what_the_store_holds(store, exporter):
    """Escaping, label order, number formatting and the prefix cache (second render)."""
    tricky = 'a "quoted" \\ back\\nslash'
    now = time.time()
    ingest(
        store,
        make_report("b-run", 3, [make_sample("loss", 1.25), make_sample("grad_norm", 1e300)]),
        make_report(
            "a.run/x",
            1_000_000,
            [make_sample("nonfinite_total", 4.0, what="grad"), make_sample("modality_loss", 0.5, modality=tricky)],
            events=[RUN_END],
        ),
        make_report(
            "a.run/x",
            7,
            [
                make_sample("softmax_saturated_ratio", -math.inf, task="ie", role="s", threshold="0.99"),
                make_sample("brand_new", 0.1),
            ],
            rank=3,
        ),
        make_report(
            "a.run/x",
            7,
            [make_sample("param_min", -1e-9, param="w"), make_sample("param_min", 12345678.0, param="v")],
            rank=1,
        ),
        now=now,
    )
    run_a, run_b = {"run": "a.run/x"}, {"run": "b-run"}
    expected_rows = [
        ("trainvitals_step", run_a, 7.0),
        ("trainvitals_step", run_b, 3.0),
        ("trainvitals_last_report_timestamp_seconds", run_a, now),
        ("trainvitals_last_report_timestamp_seconds", run_b, now),
        # The run's last report (rank 1, step 7) did not carry run_end: not ended.
        ("trainvitals_loss", run_b, 1.25),
        ("trainvitals_grad_norm", run_b, 1e300),
        ("trainvitals_nonfinite_total", {**run_a, "what": "grad"}, 4.0),
        ("trainvitals_modality_loss", {**run_a, "modality": tricky}, 0.5),
        (
            "trainvitals_softmax_saturated_ratio",
            {**run_a, "rank": "3", "task": "ie", "role": "s", "threshold": "0.99"},
            -math.inf,
        ),
        ("trainvitals_brand_new", {**run_a, "rank": "3"}, 0.1),
        ("trainvitals_param_min", {**run_a, "rank": "1", "param": "w"}, -1e-9),
        ("trainvitals_param_min", {**run_a, "rank": "1", "param": "v"}, 12345678.0),
        ("trainvitals_collector_series", {}, 12.0),
    ]
    expected = {(name, frozenset(labels.items())): v for name, labels, v in expected_rows}
    for _ in range(2):  # the second render reads the prefix cache
        got = scrape(exporter)
        got = {k: v for k, v in got.items() if k[0] != "trainvitals_collector_reports_total"}
        assert got == expected


@needs_tools("promtool")
@pytest.mark.parametrize("populated", [False, True], ids=["empty", "populated"])
def test_promtool_check_metrics_passes(store, exporter, populated):
    if populated:
        samples = [
            make_sample(name, 0.5, **labels)
            for name, labels in [
                ("loss", {}),
                ("modality_loss", {"modality": "text"}),
                ("nonfinite_total", {"what": "grad"}),
                ("softmax_saturated_ratio", {"task": "ie", "role": "teacher", "threshold": "0.99"}),
                ("param_drift_log2", {"param": "layers.0.norm.weight"}),
                ("softmax_entropy_nats", {"task": "ie", "role": "student"}),
                ("client_dropped_reports_total", {}),
            ]
        ]
        ingest(
            store,
            make_report("a", 1, samples),
            make_report("a", 1, samples[:1], rank=1, events=[RUN_END]),
        )
        assert "trainvitals_run_ended{" in exporter.render().decode()
    proc = subprocess.run(
        [require_tool("promtool"), "check", "metrics"], input=exporter.render(), capture_output=True, timeout=30
    )
    assert (proc.returncode, proc.stdout + proc.stderr) == (0, b"")


def test_render_forgets_expired_runs():
    store = SeriesStore(ttl_seconds=60)
    exporter = StoreCollector(store)
    ingest(store, make_report("old", 1), now=time.time() - 61)
    ingest(store, make_report("new", 1))
    text = exporter.render().decode()
    assert 'run="old"' not in text and 'run="new"' in text
    assert {key[0] for key in exporter._prefixes} == {"new"}
