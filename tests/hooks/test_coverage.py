"""Coverage: every report says, per built-in signal, active or why not; the collector
exports it as ``trainvitals_signal_active``; ``SignalInactive`` warns when a signal the
job asked for stays blind; ``attach`` says at start what it watches and at close what
was reported, what never engaged and what was not delivered. Real tiny models, a real
collector on port 0."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn

from tests.reports import wire_report
from tests.support import metric_series, one_torch_thread, running_collector, wait_until
from trainvitals.alerts.engine import Engine
from trainvitals.alerts.loading import load_rules
from trainvitals.hooks import attach
from trainvitals.monitor.decode import BodyInvalid, decode_batch
from trainvitals.wire import Report
from trainvitals.wire.coverage import REASONS, SIGNALS

VOCAB = 11


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


class TinyLM(nn.Module):
    """Token embedding, a norm, an LM head. ``fused``: the loss uses the head's weight
    directly (as a fused or chunked loss does), so the head module is never called."""

    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, VOCAB, bias=False)
        self.fused = fused

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(ids))
        return F.linear(h, self.lm_head.weight) if self.fused else self.lm_head(h)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, smoothing: float = 0.0) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, 6), generator=g)
        logits = model(ids)
        F.cross_entropy(logits.reshape(-1, VOCAB), ids.roll(-1, 1).reshape(-1), label_smoothing=smoothing).backward()
        opt.step()
        opt.zero_grad()


def by_signal(coverage: list[dict]) -> dict[str, dict]:
    assert [e["signal"] for e in coverage] == list(SIGNALS)
    return {e["signal"]: e for e in coverage}


# -- the wire ---------------------------------------------------------------------------
def _body(coverage: list[dict]) -> bytes:
    return json.dumps({"schema": 1, "reports": [{"run": "r", "step": 1, "time": 1.0, "coverage": coverage}]}).encode()


@pytest.mark.parametrize(
    "coverage, problem",
    [
        ([{"signal": "loss", "active": False, "reason": "no_lm_head", "detail": "x"}], None),
        ([{"signal": "loss", "active": True}], None),
        ([{"signal": "loss", "active": False}], "needs a reason"),
        ([{"signal": "loss", "active": True, "reason": "failed"}], "has no reason"),
        ([{"signal": "loss", "active": False, "reason": "it broke"}], "reason"),
        ([{"signal": "mine", "active": True}], "signal"),
        ([{"signal": "loss", "active": 1}], "active"),
        ([{"signal": "loss", "active": False, "reason": "failed", "detail": "x" * 513}], "detail"),
    ],
)
def test_the_schema_and_the_collector_decoder_agree_on_coverage(coverage, problem):
    body = _body(coverage)
    if problem is None:
        assert decode_batch(body).reports[0].coverage[0].signal == "loss"
        Report.model_validate(json.loads(body)["reports"][0])
        return
    with pytest.raises(BodyInvalid, match=problem):
        decode_batch(body)
    with pytest.raises(ValidationError, match=problem):
        Report.model_validate(json.loads(body)["reports"][0])


def test_the_monitor_refuses_reasons_outside_the_closed_list():
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters())
    with attach(model, opt, run="r", sink="null") as mon:
        with pytest.raises(ValueError, match="not one of"):
            mon.coverage.set_inactive("loss", "bad luck")
        with pytest.raises(ValueError, match="not a built-in signal"):
            mon.coverage.set_active("mine")
    assert set(REASONS) >= {"not_requested", "no_lm_head", "head_bypassed", "not_cross_entropy", "failed"}


# -- true reasons, in the report and on /metrics -----------------------------------------
def test_coverage_travels_to_metrics_as_a_per_signal_gauge_with_the_reason():
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with running_collector() as c:
        mon = attach(model, opt, run="sgd", collector=c.url, every=2)
        train(model, opt, 4)
        assert mon.flush(60)
        series = metric_series(c.client.get("/metrics").text, "trainvitals_signal_active")
        mon.close()
    got = {dict(k)["signal"]: (dict(k).get("reason"), v) for k, v in series.items() if dict(k)["run"] == "sgd"}
    assert got == {
        "optimizer": (None, 1.0),
        "params": (None, 1.0),
        "adam": ("not_adam", 0.0),
        "loss": (None, 1.0),  # read from the LM head by default
        "probe": ("not_requested", 0.0),
        "softmax": ("not_requested", 0.0),
        "packing": ("not_packed", 0.0),
    }


def test_zero_code_on_a_head_the_loss_bypasses_says_head_bypassed_and_warns(caplog):
    """The head is found, but a fused loss uses its weight without calling it: no
    gradient ever reaches its output. Healthy twin: the same model calling its head."""
    caplog.set_level(logging.INFO, logger="trainvitals")
    with running_collector() as c:
        for run, fused in (("fused", True), ("plain", False)):
            model = TinyLM(fused=fused)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            mon = attach(model, opt, run=run, collector=c.url, every=1, loss_from_logits="lm_head")
            train(model, opt, 30)
            cov = by_signal(mon.latest_coverage())
            assert mon.flush(60)
            if fused:
                assert cov["loss"]["reason"] == "head_bypassed", cov["loss"]
                assert "'lm_head'" in cov["loss"]["detail"]
                alert = c.wait_for("SignalInactive", run)
                assert alert["labels"]["signal"] == "loss" and alert["labels"]["reason"] == "head_bypassed"
            else:
                assert cov["loss"] == {"signal": "loss", "active": True}
                assert [a for a in c.alerts(run) if a["alertname"] == "SignalInactive"] == []
            mon.close()
    lines = [r.getMessage() for r in caplog.records if "run 'fused'" in r.getMessage()]
    assert "watching optimizer, params, adam, loss, packing (from the first optimizer step)" in lines[0]
    close = [m for m in lines if "closed after 30 optimizer step(s)" in m]
    assert len(close) == 1 and "never engaged: loss (head_bypassed: no gradient reached" in close[0]
    assert f"to HttpSink('{c.url}/v1/reports'), 0 not delivered" in close[0]


def test_zero_code_on_a_label_smoothed_loss_says_not_cross_entropy_and_warns(caplog):
    caplog.set_level(logging.INFO, logger="trainvitals")
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with running_collector() as c:
        mon = attach(model, opt, run="smooth", collector=c.url, every=1, loss_from_logits=True)
        train(model, opt, 25, smoothing=0.1)
        cov = by_signal(mon.latest_coverage())
        assert mon.value("loss") is None  # the figures are withheld ...
        assert cov["loss"]["reason"] == "not_cross_entropy"  # ... and the report says why
        assert mon.flush(60)
        alert = c.wait_for("SignalInactive", "smooth")
        assert alert["labels"]["reason"] == "not_cross_entropy"
        train(model, opt, 1)
        assert by_signal(mon.latest_coverage())["loss"] == {"signal": "loss", "active": True}
        mon.close()
    (close,) = [r.getMessage() for r in caplog.records if "run 'smooth' closed after" in r.getMessage()]
    # Reported once the loss was plain cross-entropy; the summary counts that report.
    assert "loss (1 report(s))" in close, close


def test_track_loss_that_is_not_called_reads_no_input():
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with attach(model, opt, run="tl", sink="null", every=1, modalities=("text",)) as mon:
        ids = torch.randint(0, VOCAB, (2, 6))
        per_token = F.cross_entropy(model(ids).reshape(-1, VOCAB), ids.reshape(-1), reduction="none").view(2, 6)
        mon.track_loss(per_token, modality=torch.zeros(2, dtype=torch.long))
        per_token.mean().backward()
        opt.step()
        opt.zero_grad()
        assert by_signal(mon.latest_coverage())["loss"] == {"signal": "loss", "active": True}
        train(model, opt, 1)  # this step calls no track_loss
        loss = by_signal(mon.latest_coverage())["loss"]
        assert loss["reason"] == "no_input" and "no track_loss call" in loss["detail"]


def test_a_signal_that_fails_reads_failed_with_the_error():
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters())
    with attach(model, opt, run="boom", sink="null", every=1) as mon:

        def boom(*a):
            raise RuntimeError("bug in a signal")

        mon.signals[1].collect = boom
        train(model, opt, 2)
        params = by_signal(mon.latest_coverage())["params"]
    assert params["reason"] == "failed" and "RuntimeError: bug in a signal" in params["detail"]


def test_the_default_rule_fires_on_blind_reasons_and_not_on_ones_that_do_not_apply():
    def fired(entries_at) -> set[tuple[str, str]]:
        eng = Engine(load_rules("default"))
        out = set()
        for step in range(0, 100, 10):
            report = Report.model_validate({**wire_report(step).model_dump(), "coverage": entries_at(step)})
            for t in eng.observe(report, now=1000.0 + step):
                if t.alertname == "SignalInactive" and t.state.value == "firing":
                    out.add((t.labels["signal"], t.labels["reason"]))
        return out

    blind = [{"signal": "loss", "active": False, "reason": "no_lm_head", "detail": "none"}]
    assert fired(lambda s: blind) == {("loss", "no_lm_head")}
    moot = [
        {"signal": "optimizer", "active": True},
        {"signal": "adam", "active": False, "reason": "not_adam"},
        {"signal": "params", "active": False, "reason": "no_parameters"},
        {"signal": "loss", "active": False, "reason": "not_requested"},
        {"signal": "softmax", "active": False, "reason": "no_input"},
    ]
    assert fired(lambda s: moot) == set()
    # Blind for one report only: quiet.
    once = [{"signal": "loss", "active": True}]
    assert fired(lambda s: blind if s == 30 else once) == set()
    # Every figure withheld report after report (never active without a figure): blind,
    # unlike no_input (nothing reached it); withheld once: quiet.
    withheld = [{"signal": "loss", "active": False, "reason": "withheld", "detail": "its figures were all withheld"}]
    assert fired(lambda s: withheld) == {("loss", "withheld")}
    assert fired(lambda s: withheld if s == 30 else once) == set()


# -- start and close lines; the silent paths --------------------------------------------
def test_close_after_no_optimizer_step_says_nothing_was_watched(caplog):
    caplog.set_level(logging.INFO, logger="trainvitals")
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters())
    with running_collector() as c:
        mon = attach(model, opt, run="idle", collector=c.url)
        mon.close()
        wait_until(lambda: c.client.get("/v1/runs").json(), what="the run_end report")
        series = metric_series(c.client.get("/metrics").text, "trainvitals_signal_active")
    reasons = {dict(k)["signal"]: dict(k).get("reason") for k in series}
    assert reasons["optimizer"] == reasons["params"] == reasons["adam"] == "no_optimizer_step"
    (line,) = [r for r in caplog.records if "closed after" in r.getMessage()]
    assert line.levelno == logging.WARNING
    assert "closed after 0 optimizer step(s); NOTHING was watched: no optimizer step ran" in line.getMessage()


def test_attach_twice_on_one_optimizer_is_refused():
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters())
    with attach(model, opt, run="one", sink="null"):
        with pytest.raises(ValueError, match=r"already has a monitor \(run 'one'\)"):
            attach(model, opt, run="two", sink="null")
    attach(model, opt, run="two", sink="null").close()  # once closed, a new one may attach


def test_a_collector_url_with_the_route_appended_names_the_base_url(caplog):
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters())
    with running_collector() as c:
        mon = attach(model, opt, run="url", collector=c.url + "/v1/reports", every=1)
        train(model, opt, 5)
        mon.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    wrong = f"POST {c.url}/v1/reports/v1/reports answered 404"
    assert sum(wrong in m for m in warnings) == 2, warnings  # once when it happens, once in the summary
    assert f"pass the collector's base URL '{c.url}'" in warnings[0]
    assert "6 not delivered" in warnings[-1]
