"""ParamHealth (docs/incidents.md I4): every statistic against a slow element-wise
reference on a tiny CPU model, the weight-decay audit, the series cap."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from tests.hooks._param_models import OPTIMIZERS, Tiny, param_reference, series, train
from trainvitals.hooks import attach
from trainvitals.hooks.grad_norms import GradNorms

PARAM_METRICS = (
    "param_min",
    "param_max",
    "param_absmax",
    "param_drift_log2",
    "param_drift_consistency_ratio",
    "param_weight_decay",
    "param_grad_relative_rms",
)


def monitored(opt_name: str = "adam", **options):
    model = Tiny(0)
    opt = OPTIMIZERS[opt_name](model)
    options.setdefault("signals", ("params",))
    mon = attach(model, opt, run="params", sink="null", **options)
    return model, opt, mon


@pytest.mark.parametrize("every", [1, 3], ids=["every-1", "every-3"])
@pytest.mark.parametrize("opt_name", ["adam", "adamw-groups", "sgd-momentum"])
def test_statistics_match_the_elementwise_reference(opt_name, every):
    window = 4  # short, so the ring wraps within the run
    model, opt, mon = monitored(opt_name, every=every, drift_window=window)
    history = train(model, opt, mon, 16)
    mon.close()
    assert len(history.reports) == len([s for s in range(1, 17) if s == 1 or s % every == 0])
    for k, samples in enumerate(history.reports):
        ref = param_reference(model, opt, history, k, window)
        for metric in PARAM_METRICS:
            got = series(samples, metric)
            assert got.keys() == ref[metric].keys(), metric
            for name, want in ref[metric].items():
                assert got[name] == pytest.approx(want, rel=1e-5, abs=1e-6), (k, metric, name)


def test_series_are_the_1d_parameters_in_name_order_with_clean_names():
    model, opt, mon = monitored()
    train(model, opt, mon, 1)
    names = [s["labels"]["param"] for s in mon.latest() if s["name"] == "param_min"]
    assert names == ["lin1.bias", "lin2.bias", "norm.bias", "norm.weight", "scale"]
    mon.close()


def test_drift_is_zero_at_attach_scale_and_counts_bits_gained():
    model, opt, mon = monitored()
    train(model, opt, mon, 1)
    with torch.no_grad():
        model.scale.fill_(4.0)  # 1.0 at attach: two bits gained
    train(model, opt, mon, 1, start=1)  # every=10: step 2 is not reported
    assert mon.step == 2
    opt.param_groups[0]["lr"] = 0.0
    for i in range(8):
        train(model, opt, mon, 1, start=2 + i)
    assert mon.step == 10
    assert mon.value("param_drift_log2", param="scale") == pytest.approx(2.0, abs=0.02)
    mon.close()


def test_consistency_is_one_for_a_monotonic_walk_and_zero_when_still():
    model, opt, mon = monitored(every=1, drift_window=5)
    for step in range(6):
        with torch.no_grad():
            model.scale.add_(0.1)  # walks up between reports
        opt.param_groups[0]["lr"] = 0.0  # nothing else moves
        train(model, opt, mon, 1, start=step)
    assert mon.value("param_drift_consistency_ratio", param="scale") == pytest.approx(1.0)
    assert mon.value("param_drift_consistency_ratio", param="norm.weight") == 0.0
    mon.close()


def test_consistency_averages_elements_walking_in_opposite_directions():
    """Per element: half the elements walking up and half down still read 1."""
    model, opt, mon = monitored(every=1)
    opt.param_groups[0]["lr"] = 0.0
    direction = torch.tensor([1.0, -1.0] * 6)
    for step in range(4):
        with torch.no_grad():
            model.norm.weight.add_(0.01 * direction)
        train(model, opt, mon, 1, start=step)
    assert mon.value("param_drift_consistency_ratio", param="norm.weight") == pytest.approx(1.0)
    mon.close()


def test_zero_initialized_parameter_takes_its_first_nonzero_absmax_as_reference():
    model, opt, mon = monitored(every=1)
    assert float(model.norm.bias.detach().abs().max()) == 0.0
    train(model, opt, mon, 1)
    assert mon.value("param_drift_log2", param="norm.bias") == 0.0
    first = mon.value("param_absmax", param="norm.bias")
    train(model, opt, mon, 3, start=1)
    now = mon.value("param_absmax", param="norm.bias")
    assert mon.value("param_drift_log2", param="norm.bias") == pytest.approx(math.log2(now / first), rel=1e-5)
    mon.close()


def test_relative_grad_rms_is_absent_for_a_parameter_without_gradient():
    model, opt, mon = monitored(every=1)
    model.scale.requires_grad_(False)
    train(model, opt, mon, 2)
    assert mon.value("param_grad_relative_rms", param="scale") is None
    assert mon.value("param_grad_relative_rms", param="lin2.bias") is not None
    assert mon.value("param_min", param="scale") == 1.0
    mon.close()


def test_weight_decay_audit_logs_one_line_and_sends_one_event(caplog):
    model = Tiny(0)
    extra = [torch.nn.Parameter(torch.zeros(3)) for _ in range(5)]
    for i, p in enumerate(extra):
        model.register_parameter(f"extra{i}", p)
    opt = OPTIMIZERS["adamw-groups"](model)
    with caplog.at_level(logging.INFO, logger="trainvitals"):
        mon = attach(model, opt, run="audit", sink="null", every=1, signals=("params",))
    lines = [r.getMessage() for r in caplog.records if "weight-decay audit" in r.getMessage()]
    assert len(lines) == 1
    assert "10 of 10 1D parameters get no weight decay" in lines[0]
    assert "extra0, extra1, extra2, extra3, extra4 and 5 more" in lines[0]
    train(model, opt, mon, 1)
    assert [e["kind"] for e in mon.latest_events()] == ["weight_decay_audit"]
    train(model, opt, mon, 1, start=1)
    assert mon.latest_events() == []  # only the first report carries it
    mon.close()


def test_weight_decay_audit_event_is_in_the_first_report():
    model = Tiny(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    mon = attach(model, opt, run="audit", sink="null", signals=("params",))
    train(model, opt, mon, 1)
    (event,) = [e for e in mon.latest_events() if e["kind"] == "weight_decay_audit"]
    assert event["detail"] == "weight-decay audit: 0 of 5 1D parameters get no weight decay"
    mon.close()


def test_series_are_capped_by_name_order_and_the_cut_is_logged_once(caplog):
    with caplog.at_level(logging.WARNING, logger="trainvitals"):
        model, opt, mon = monitored(every=1, max_param_series=2, signals=("params", "adam"))
        train(model, opt, mon, 3)
    assert sorted(series(mon.latest(), "param_drift_log2")) == ["lin1.bias", "lin2.bias"]
    assert sorted(k for k in series(mon.latest(), "adam_exp_avg_norm")) == ["0", "lin1.bias", "lin2.bias"]
    cut = [r for r in caplog.records if "max_param_series=2" in r.getMessage()]
    assert len(cut) == 1
    mon.close()


def test_the_cut_is_in_a_report_too_naming_what_has_no_series():
    model, opt, mon = monitored(every=1, max_param_series=2, signals=("params", "adam"))
    seen = []
    for _ in range(3):
        train(model, opt, mon, 1)
        seen += [e for e in mon.latest_events() if e["kind"] == "param_series_cut"]
    (event,) = seen  # once per attach, though two signals choose the series
    assert event["detail"] == (
        "2 of 5 1D parameters have their own series (max_param_series=2); without: norm.bias, norm.weight, scale"
    )
    mon.close()


def test_per_param_adds_relative_grad_rms_for_matrices():
    model, opt, mon = monitored(every=1, per_param=True)
    history = train(model, opt, mon, 2)
    got = series(mon.latest(), "param_grad_relative_rms")
    assert set(got) == {"lin1.bias", "lin1.weight", "lin2.bias", "lin2.weight", "norm.bias", "norm.weight", "scale"}
    grads = history.grads[-1]
    rms = {n: math.sqrt(float(g.double().square().mean())) for n, g in grads.items()}
    median = float(torch.tensor(list(rms.values()), dtype=torch.float64).median())
    assert got["lin1.weight"] == pytest.approx(rms["lin1.weight"] / median, rel=1e-5)
    assert series(mon.latest(), "param_min").keys() == {"lin1.bias", "lin2.bias", "norm.bias", "norm.weight", "scale"}
    mon.close()


def test_added_param_group_restarts_consistency_and_reports_new_parameters():
    model = Tiny(0)
    opt = torch.optim.Adam([p for n, p in model.named_parameters() if not n.startswith("lin2")], lr=0.01)
    mon = attach(model, opt, run="grow", sink="null", every=1, signals=("params",))
    train(model, opt, mon, 2)
    assert "lin2.bias" not in series(mon.latest(), "param_min")
    opt.add_param_group({"params": list(model.lin2.parameters()), "weight_decay": 0.5})
    first_seen = model.lin2.bias.detach().clone()  # its reference: before its first step
    train(model, opt, mon, 1, start=2)
    assert series(mon.latest(), "param_weight_decay")["lin2.bias"] == 0.5
    moved = float((model.lin2.bias.detach() - first_seen).abs().max())
    want = math.log2(1 + moved / float(first_seen.abs().max()))
    assert series(mon.latest(), "param_drift_log2")["lin2.bias"] == pytest.approx(want, rel=1e-5)
    assert "param_drift_consistency_ratio" not in {s["name"] for s in mon.latest()}
    train(model, opt, mon, 1, start=3)
    assert "lin2.bias" in series(mon.latest(), "param_drift_consistency_ratio")
    mon.close()


def test_nothing_runs_between_reports(monkeypatch):
    taken = []
    applied = GradNorms.applied.__func__
    monkeypatch.setattr(GradNorms, "applied", classmethod(lambda cls, *a: taken.append(1) or applied(cls, *a)))
    model, opt, mon = monitored(every=5)
    train(model, opt, mon, 1)  # step 1: reported, the gradient norms taken once
    assert len(taken) == 1
    train(model, opt, mon, 1, start=1)  # step 2: not reported
    assert len(taken) == 1
    mon.close()
