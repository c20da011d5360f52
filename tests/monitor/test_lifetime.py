"""The collector's lifetime drift (monitor/lifetime.py) against the hooks' definition,
``log2(1 + max|x - x_ref| / scale)``, computed here by hand on plain numbers."""

from __future__ import annotations

import math

import pytest

from trainvitals.monitor.decode import WireBatch, WireReport, WireSample
from trainvitals.monitor.lifetime import LifetimeDrift


def _report(step: int, drift: float, absmax: float, ref: float, scale: float) -> WireBatch:
    labels = {"param": "norm.weight"}
    samples = [
        WireSample("param_drift_log2", drift, labels),
        WireSample("param_absmax", absmax, labels),
        WireSample("param_drift_reference_absmax", ref, labels),
        WireSample("param_drift_scale", scale, labels),
    ]
    return WireBatch(1, [WireReport("r", step, 0.0, samples=samples)])


def _drift(batch: WireBatch) -> float:
    return next(s.value for s in batch.reports[0].samples if s.name == "param_drift_lifetime_log2")


def test_one_segment_is_reported_as_the_hooks_measured_it():
    # A vector [1, -1] -> [1, 1]: its absmax stays 1 while its largest move is 2 (1.58 bits).
    # Within one segment (one reference) the collector never touches the figure.
    life = LifetimeDrift()
    for step, drift in ((10, 0.0), (20, math.log2(1 + 2 / 1))):
        batch = _report(step, drift, absmax=1.0, ref=1.0, scale=1.0)
        assert life.apply(batch, now=0.0) == 0
        assert _drift(batch) == drift


def test_a_resumed_segment_is_judged_since_the_first_reference():
    life = LifetimeDrift()
    life.apply(_report(10, 0.5, absmax=2**0.5, ref=1.0, scale=1.0), now=0.0)
    # Resumed at 1.8 without the monitor's state: its own reference is 1.8, its own drift
    # small; since the run's first reference (1.0) the scalar moved by 2.6 - 1.0.
    own = math.log2(1 + (2.6 - 1.8) / 1.8)
    batch = _report(40, own, absmax=2.6, ref=1.8, scale=1.8)
    assert life.apply(batch, now=1.0) == 1
    assert _drift(batch) == pytest.approx(math.log2(1 + (2.6 - 1.0) / 1.0))
    assert life.reference("r", "norm.weight") == 1.0
    # A segment whose own figure is the larger one keeps it (the bound is only a bound).
    batch = _report(50, 3.0, absmax=1.1, ref=1.05, scale=1.05)
    life.apply(batch, now=2.0)
    assert _drift(batch) == 3.0


def test_the_first_scale_is_the_one_judged_against():
    # A tiny parameter judged against its neighbours' floor (scale 0.1, absmax 1e-4) keeps
    # that floor across segments: 1e-4 -> 2e-3 is no range at stake.
    life = LifetimeDrift()
    life.apply(_report(10, 0.0, absmax=1e-4, ref=1e-4, scale=0.1), now=0.0)
    batch = _report(40, 0.0, absmax=2e-3, ref=2e-3, scale=0.1)
    life.apply(batch, now=1.0)
    assert _drift(batch) == pytest.approx(math.log2(1 + (2e-3 - 1e-4) / 0.1))
    assert _drift(batch) < 0.05


def test_the_drift_is_kept_as_sent_and_the_rules_judge_the_lifetime_figure():
    from trainvitals.monitor.lifetime import judged

    life = LifetimeDrift()
    life.apply(_report(10, 0.5, absmax=2**0.5, ref=1.0, scale=1.0), now=0.0)
    own = math.log2(1 + (2.6 - 1.8) / 1.8)
    batch = _report(40, own, absmax=2.6, ref=1.8, scale=1.8)
    life.apply(batch, now=1.0)
    (report,) = batch.reports
    sent = [s.value for s in report.samples if s.name == "param_drift_log2"]
    assert sent == [own]  # the job's figure, untouched
    view = judged(report)
    assert [s.value for s in view.samples if s.name == "param_drift_log2"] == [
        pytest.approx(math.log2(1 + (2.6 - 1.0) / 1.0))
    ]
    assert [s.value for s in report.samples if s.name == "param_drift_log2"] == [own]  # a view, not a rewrite


def test_an_unusable_reference_gets_no_lifetime_figure():
    life = LifetimeDrift()
    batch = _report(10, 0.5, absmax=1.0, ref=0.0, scale=1.0)
    life.apply(batch, now=0.0)
    assert [s.name for s in batch.reports[0].samples if s.name == "param_drift_lifetime_log2"] == []
