"""Exposition: families built from the store at scrape time, on a private registry."""

from __future__ import annotations

import logging
import math
import shutil
import subprocess
import time

import pytest
from prometheus_client.metrics_core import GaugeMetricFamily

from tests.reports import make_body, make_report
from trainvitals.monitor.exposition import (
    REPORT_OUTCOMES,
    ReportCounter,
    make_registry,
    render,
)
from trainvitals.monitor.store import SeriesStore
from trainvitals.wire import ReportBatch


def ingest(store: SeriesStore, *reports: dict, now: float | None = None) -> None:
    store.ingest(ReportBatch.model_validate(make_body(*reports)), now)


def sample(name: str, value: float, **labels: str) -> dict:
    return {"name": name, "labels": labels, "value": value}


@pytest.fixture
def store() -> SeriesStore:
    return SeriesStore()


def test_store_series_appear_with_run_label_and_per_run_series(store):
    registry, _ = make_registry(store)
    now = time.time()
    ingest(
        store,
        make_report("mm-pt1", 120, [sample("modality_grad_share_ratio", 0.0094, modality="image")]),
        make_report("mm-pt1", 120, [sample("grad_norm", 2.0, group="all")], rank=3),
        now=now,
    )
    get = registry.get_sample_value
    assert (
        get("trainvitals_modality_grad_share_ratio", {"run": "mm-pt1", "modality": "image"})
        == 0.0094
    )
    assert get("trainvitals_grad_norm", {"run": "mm-pt1", "group": "all", "rank": "3"}) == 2.0
    assert get("trainvitals_step", {"run": "mm-pt1"}) == 120
    assert get("trainvitals_last_report_timestamp_seconds", {"run": "mm-pt1"}) == now


def test_counters_are_exposed_with_total_suffix_and_no_created(store):
    registry, _ = make_registry(store)
    ingest(store, make_report("a", 1, [sample("optimizer_state_resets_total", 2.0)]))
    assert (
        registry.get_sample_value("trainvitals_optimizer_state_resets_total", {"run": "a"}) == 2.0
    )
    text = render(registry).decode()
    assert "# TYPE trainvitals_optimizer_state_resets_total counter" in text
    assert "_created" not in text


def test_help_comes_from_the_wire_catalogue(store):
    registry, _ = make_registry(store)
    ingest(
        store, make_report("a", 1, [sample("loss", 1.0, modality="text"), sample("brand_new", 1.0)])
    )
    text = render(registry).decode()
    assert "# HELP trainvitals_loss Mean per-token loss" in text
    assert "# HELP trainvitals_brand_new Sent by a trainvitals client" in text


def test_expired_runs_vanish_from_the_scrape():
    store = SeriesStore(ttl_seconds=0.001)
    registry, _ = make_registry(store)
    ingest(store, make_report("a", 1), now=1.0)
    assert registry.get_sample_value("trainvitals_step", {"run": "a"}) is None
    assert "run=" not in render(registry).decode()


def test_report_outcomes_are_all_present_from_the_start(store):
    reports = ReportCounter()
    registry, _ = make_registry(store, reports)
    for outcome in REPORT_OUTCOMES:
        assert (
            registry.get_sample_value("trainvitals_collector_reports_total", {"outcome": outcome})
            == 0
        )
    reports.inc("accepted", 5)
    reports.inc("bad_gzip")
    assert (
        registry.get_sample_value("trainvitals_collector_reports_total", {"outcome": "accepted"})
        == 5
    )
    assert (
        registry.get_sample_value("trainvitals_collector_reports_total", {"outcome": "bad_gzip"})
        == 1
    )
    with pytest.raises(ValueError, match="unknown outcome"):
        reports.inc("meh")


def test_family_sources_extend_the_scrape_and_can_be_removed(store, caplog):
    registry, exporter = make_registry(store)

    def alerts():
        fam = GaugeMetricFamily(
            "trainvitals_alerts_firing", "Alerts firing now.", labels=["alertname", "severity"]
        )
        fam.add_metric(["GradientDilution", "page"], 1)
        return [fam]

    def broken():
        raise RuntimeError("boom")

    handle = exporter.register_family_source(alerts)
    exporter.register_family_source(broken)
    labels = {"alertname": "GradientDilution", "severity": "page"}
    assert registry.get_sample_value("trainvitals_alerts_firing", labels) == 1
    with caplog.at_level(logging.ERROR, logger="trainvitals.monitor.exposition"):
        text = render(registry).decode()
    assert "family source" in caplog.text
    assert 'trainvitals_alerts_firing{alertname="GradientDilution",severity="page"} 1.0' in text

    handle.remove()
    assert registry.get_sample_value("trainvitals_alerts_firing", labels) is None


def test_nan_and_inf_render(store):
    registry, _ = make_registry(store)
    ingest(
        store,
        make_report(
            "a",
            1,
            [sample("grad_norm", math.nan, group="all"), sample("loss", -math.inf, modality="x")],
        ),
    )
    text = render(registry).decode()
    assert 'trainvitals_grad_norm{group="all",run="a"} NaN' in text
    assert 'trainvitals_loss{modality="x",run="a"} -Inf' in text


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
@pytest.mark.parametrize("populated", [False, True], ids=["empty", "populated"])
def test_promtool_check_metrics_passes(store, populated):
    registry, _ = make_registry(store, ReportCounter())
    if populated:
        samples = [
            sample(name, 0.5, **labels)
            for name, labels in [
                ("loss", {"modality": "text"}),
                ("nonfinite_total", {"what": "grad"}),
                ("softmax_saturated_ratio", {"task": "ie", "role": "teacher", "threshold": "0.99"}),
                ("param_drift_log2", {"param": "layers.0.norm.weight"}),
                ("softmax_entropy_nats", {"task": "ie", "role": "student"}),
                ("client_dropped_reports_total", {}),
            ]
        ]
        ingest(store, make_report("a", 1, samples), make_report("a", 1, samples[:1], rank=1))
    proc = subprocess.run(
        ["promtool", "check", "metrics"], input=render(registry), capture_output=True, timeout=30
    )
    assert (proc.returncode, proc.stdout + proc.stderr) == (0, b"")


def test_fast_render_matches_generate_latest(store):
    """StoreCollector.render() (what /metrics serves) writes what generate_latest would."""
    registry, exporter = make_registry(store)
    exporter.register_family_source(
        lambda: [GaugeMetricFamily("trainvitals_alerts_firing", "Alerts firing now.", value=0)]
    )
    tricky = 'a "quoted" \\ back\nslash'
    ingest(
        store,
        make_report(
            "b-run",
            3,
            [sample("loss", 1.25, modality="text"), sample("grad_norm", 1e300, group="all")],
        ),
        make_report(
            "a.run/x",
            1_000_000,
            [
                sample("nonfinite_total", 4.0, what="grad"),
                sample("loss", math.nan, modality=tricky),
            ],
        ),
        make_report(
            "a.run/x",
            7,
            [
                sample("softmax_saturated_ratio", -math.inf, task="ie", role="s", threshold="0.99"),
                sample("brand_new", 0.1),
            ],
            rank=3,
        ),
        make_report(
            "a.run/x",
            7,
            [sample("param_min", -1e-9, param="w"), sample("param_min", 12345678.0, param="v")],
            rank=1,
        ),
    )
    for _ in range(2):  # the second render reads the prefix cache
        assert exporter.render().decode() == render(registry).decode()


def test_fast_render_forgets_expired_runs():
    store = SeriesStore(ttl_seconds=60)
    registry, exporter = make_registry(store)
    ingest(store, make_report("old", 1), now=time.time() - 61)
    ingest(store, make_report("new", 1))
    text = exporter.render().decode()
    assert 'run="old"' not in text and 'run="new"' in text
    assert {key[0] for key in exporter._prefixes} == {"new"}
