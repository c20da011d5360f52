"""I4 (docs/incidents.md) reproduced on a tiny CPU model: a learnable output scale whose
gradient is tiny but consistently signed (scaled by 1e-9, plus small biased noise
standing in for low-precision rounding), no weight decay, Adam(eps=1e-8). Adam's
normalization turns that gradient into full-size steps and the scale walks away.
The same model has biases the loss itself moves far and steadily (targets offset by
+3); they must not look like the incident. An optimizer state reset mid-run is
counted. Healthy twins: the write-up's fix (a hook that zeros the gradient), a scale
that gets its real gradient, and weight decay on it."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from trainvitals.hooks import attach

STEPS, EVERY, RESET_AFTER = 120, 10, 60


class Readout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin1 = nn.Linear(8, 16)
        self.lin2 = nn.Linear(16, 4)
        self.out_scale = nn.Parameter(torch.tensor(1.0))  # the RMSNorm scale before the logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.tanh(self.lin1(x))) * self.out_scale


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g) * 0.1 + 3.0


def param_drift(mon, param: str) -> bool:
    """The default ParamDrift rule's conditions on one report."""
    v = lambda name: mon.value(name, param=param)  # noqa: E731
    return (
        v("param_drift_log2") > 1
        and v("param_drift_consistency_ratio") > 0.6
        and v("param_weight_decay") < 1e-12
        and v("param_grad_relative_rms") < 0.01
    )


def run(variant: str, reset: bool = True) -> list[dict]:
    """Train; return per report the values the assertions need."""
    model = Readout()
    if variant == "weight-decay":
        opt = torch.optim.AdamW(
            [
                {"params": [model.out_scale], "weight_decay": 1.0},
                {"params": [p for n, p in model.named_parameters() if n != "out_scale"], "weight_decay": 0.0},
            ],
            lr=0.05,
            eps=1e-8,
        )
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.05, eps=1e-8)
    noise = torch.Generator().manual_seed(7)
    if variant in ("bug", "weight-decay"):
        # Tiny and biased negative (the write-up: 82% of the rounding noise one way).
        model.out_scale.register_hook(lambda g: g * 1e-9 + (torch.randn((), generator=noise) * 2e-9 - 4e-9))
    elif variant == "zero-grad-hook":
        model.out_scale.register_hook(torch.zeros_like)
    mon = attach(model, opt, run=f"i4-{variant}", sink="null", every=EVERY, signals=("params", "adam"))
    out = []
    for i in range(1, STEPS + 1):
        x, y = batch(i)
        (model(x) - y).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if reset and i == RESET_AFTER:
            opt.state.clear()  # a new stage rebuilds the optimizer state
        if mon.reports_at(i):
            row = {
                "step": i,
                "resets": mon.value("optimizer_state_resets_total"),
                "events": [e["kind"] for e in mon.latest_events()],
            }
            for p in ("out_scale", "lin1.bias", "lin2.bias"):
                row[p] = {
                    name: mon.value(name, param=p)
                    for name in (
                        "param_drift_log2",
                        "param_drift_consistency_ratio",
                        "param_weight_decay",
                        "param_grad_relative_rms",
                        "adam_eps_dominated_ratio",
                        "adam_normalized_update_rms",
                    )
                }
                row[p]["rule"] = param_drift(mon, p)
            out.append(row)
    mon.close()
    return out


@pytest.fixture(scope="module")
def bug() -> list[dict]:
    return run("bug")


def test_the_drifting_scale_shows_while_it_happens(bug):
    drift = [r["out_scale"]["param_drift_log2"] for r in bug]
    assert all(b > a for a, b in itertools.pairwise(drift))  # a monotonic walk, report after report
    assert drift[-1] > 1.0  # more than a bit of dynamic range gained
    for r in bug:
        s = r["out_scale"]
        assert s["param_drift_consistency_ratio"] > 0.99
        assert s["param_weight_decay"] == 0.0
        assert s["param_grad_relative_rms"] < 1e-5
        assert s["adam_eps_dominated_ratio"] == 1.0  # sqrt(v_hat) < eps: Adam divides by ~eps
        assert s["adam_normalized_update_rms"] > 0.01  # ... and still takes real steps
    fired = [r["step"] for r in bug if r["out_scale"]["rule"]]
    assert fired and fired == [r["step"] for r in bug if r["step"] >= fired[0]]


def test_biases_the_loss_moves_do_not_look_like_the_incident(bug):
    """They move far and steadily too, but with real gradient."""
    assert max(r["lin2.bias"]["param_drift_log2"] for r in bug) > 1.0
    assert bug[1]["lin2.bias"]["param_drift_consistency_ratio"] == 1.0
    for r in bug:
        for p in ("lin1.bias", "lin2.bias"):
            assert r[p]["param_grad_relative_rms"] > 0.1
            assert not r[p]["rule"]


def test_the_state_reset_is_counted_once_with_an_event(bug):
    for r in bug:
        after = r["step"] > RESET_AFTER
        assert r["resets"] == (1.0 if after else 0.0)
        assert ("optimizer_state_reset" in r["events"]) == (r["step"] == RESET_AFTER + EVERY)


def test_healthy_twin_with_the_gradient_zeroed_does_not_move():
    rows = run("zero-grad-hook")
    for r in rows:
        s = r["out_scale"]
        assert s["param_drift_log2"] == 0.0
        assert s["param_drift_consistency_ratio"] == 0.0
        assert s["adam_normalized_update_rms"] == 0.0  # m stays 0: Adam does not move it
        assert not any(r[p]["rule"] for p in ("out_scale", "lin1.bias", "lin2.bias"))


@pytest.mark.parametrize("variant", ["real-gradient", "weight-decay"])
def test_healthy_twins_do_not_match_the_incident(variant):
    rows = run(variant, reset=False)
    for r in rows:
        assert not any(r[p]["rule"] for p in ("out_scale", "lin1.bias", "lin2.bias"))
        assert r["resets"] == 0.0 and "optimizer_state_reset" not in r["events"]
    s = rows[-1]["out_scale"]
    if variant == "real-gradient":
        assert s["param_grad_relative_rms"] > 0.01
    else:
        assert s["param_weight_decay"] == 1.0
        assert s["param_drift_log2"] < 1.0
