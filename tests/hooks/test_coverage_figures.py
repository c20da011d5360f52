"""Never active without a figure: a coverage entry still active whose signal carries no
sample in the report as sent (its figures all withheld by their presence flags) reads
inactive, ``withheld``, in that report."""

from __future__ import annotations

import json

import torch

from tests.hooks.test_coverage import TinyLM, train
from tests.support import one_torch_thread
from trainvitals.hooks import attach
from trainvitals.hooks.coverage import without_figures


def _entry(signal: str) -> dict:
    return {"signal": signal, "active": True, "reason": None, "detail": ""}


def test_an_active_signal_without_a_sample_turns_inactive():
    coverage = [_entry("loss"), _entry("optimizer"), _entry("probe")]
    samples = [{"name": "grad_norm", "labels": {}, "value": 1.0}]
    without_figures(coverage, samples)
    loss, optimizer, probe = coverage
    assert (loss["active"], loss["reason"]) == (False, "withheld")
    assert "withheld" in loss["detail"]
    assert optimizer["active"] and optimizer["reason"] is None
    assert probe["active"]  # no metric group of its own: judged by what it emitted, as before


def test_a_signal_with_one_figure_stays_active_and_inactive_entries_keep_their_reason():
    coverage = [_entry("loss"), {"signal": "adam", "active": False, "reason": "sharded", "detail": "why"}]
    without_figures(coverage, [{"name": "loss_weight_mass", "labels": {"objective": "main"}, "value": 1.0}])
    assert coverage[0]["active"]
    assert (coverage[1]["reason"], coverage[1]["detail"]) == ("sharded", "why")


def test_the_run_end_report_keeps_the_last_reports_coverage_as_sent(tmp_path):
    """The run_end report carries no figure; its coverage is the last report's, judged
    against that report's figures: not turned ``withheld`` for its own empty samples."""
    path = tmp_path / "r.jsonl"
    with one_torch_thread():
        model = TinyLM()
        opt = torch.optim.AdamW(model.parameters())
        mon = attach(model, opt, run="end", sink=f"file:{path}", every=1)
        train(model, opt, 3)
        mon.close()
    reports = [json.loads(line) for line in path.read_text().splitlines()]
    last, end = reports[-2], reports[-1]
    assert [e["kind"] for e in end["events"]] == ["run_end"]
    assert not [s for s in end["samples"] if s["name"] != "client_dropped_reports_total"]
    active = {e["signal"] for e in last["coverage"] if e["active"]}
    assert {"optimizer", "loss"} <= active
    assert end["coverage"] == last["coverage"]
