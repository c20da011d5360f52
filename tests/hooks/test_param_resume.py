"""I4 on its real time scale: drift keeps counting across checkpoint resumes
(``Monitor.state_dict()`` / ``load_state_dict()``), and a walk through zero that
changes the sign reads as drift too."""

from __future__ import annotations

import math

import pytest
import torch
from test_param_i4 import Readout, batch, param_drift

from trainvitals.hooks import attach

SEGMENT = 40  # steps between checkpoint resumes


def _biased_noise_hook(model: Readout, gen: torch.Generator, sign: float, size: float = 4e-9) -> None:
    """A tiny gradient of constant sign, as biased low-precision rounding noise gives."""
    model.out_scale.register_hook(lambda g: g * 1e-9 + sign * size * (1 + torch.randn((), generator=gen) * 0.5))


def _train(model, opt, mon, start: int, steps: int) -> None:
    for i in range(start, start + steps):
        x, y = batch(i)
        (model(x) - y).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _segments(carry_state: bool, tmp_path) -> list[float]:
    """Three segments, each a new process's worth of objects restored from a checkpoint
    file; returns the scale's drift at the end of each."""
    checkpoint = tmp_path / "ckpt.pt"
    drifts = []
    for seg in range(3):
        model = Readout()
        opt = torch.optim.Adam(model.parameters(), lr=0.05, eps=1e-8)
        gen = torch.Generator().manual_seed(7 + seg)
        _biased_noise_hook(model, gen, sign=-1.0)
        saved = torch.load(checkpoint, weights_only=False) if seg else None
        if saved is not None:  # the job restores its checkpoint, then attaches
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
        mon = attach(model, opt, run="resume", sink="null", every=10, signals=("params", "adam"))
        if saved is not None and carry_state:
            mon.load_state_dict(saved["monitor"])
        _train(model, opt, mon, seg * SEGMENT + 1, SEGMENT)
        drifts.append(mon.value("param_drift_log2", param="out_scale"))
        fired = param_drift(mon, "out_scale")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "monitor": mon.state_dict()}, checkpoint)
        mon.close()
    drifts.append(fired)
    return drifts


def test_drift_continues_across_resumes(tmp_path):
    *carried, fired = _segments(carry_state=True, tmp_path=tmp_path)
    *fresh, fired_fresh = _segments(carry_state=False, tmp_path=tmp_path)
    # Without the monitor's state each segment starts over and stays under a bit ...
    assert all(d < 1.0 for d in fresh) and not fired_fresh, fresh
    # ... with it the drift is measured from the original reference, and the rule fires.
    assert carried[0] == pytest.approx(fresh[0], rel=1e-6)
    assert carried[0] < carried[1] < carried[2] and carried[2] > 1.0 and fired, carried
    scale = 1.0 + (2 ** carried[2] - 1)  # the scale started at 1.0 and only grew
    assert carried[2] == pytest.approx(math.log2(scale), rel=1e-6)


def test_step_numbering_and_counters_continue(tmp_path):
    model = Readout()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    mon = attach(model, opt, run="resume", sink="null", every=1)
    _train(model, opt, mon, 1, 5)
    state = mon.state_dict()
    mon.close()
    again = attach(model, opt, run="resume", sink="null", every=1)
    again.load_state_dict(state)
    _train(model, opt, again, 6, 1)
    assert again.step == 6
    assert again.value("optimizer_state_resets_total") == 0.0  # a reloaded state is no reset
    assert again.value("nonfinite_total", what="grad") == 0.0
    again.close()


def test_load_state_dict_refuses_what_is_not_a_monitor_state():
    model = Readout()
    opt = torch.optim.Adam(model.parameters())
    with attach(model, opt, run="x", sink="null") as mon:
        with pytest.raises(ValueError, match=r"Monitor\.state_dict"):
            mon.load_state_dict({"step": 3})
        with pytest.raises(ValueError, match=r"Monitor\.state_dict"):
            mon.load_state_dict(opt.state_dict())


def test_a_walk_through_zero_reads_as_drift():
    """1.0 -> about -0.3: the absmax shrinks, but the parameter moved 1.3 of its range."""
    model = Readout()
    opt = torch.optim.Adam(model.parameters(), lr=0.02, eps=1e-8)
    # Larger than the model's pull back towards 1 as the scale shrinks, still tiny.
    _biased_noise_hook(model, torch.Generator().manual_seed(3), sign=+1.0, size=1e-7)
    mon = attach(model, opt, run="zero-crossing", sink="null", every=10, signals=("params", "adam"))
    _train(model, opt, mon, 1, 150)
    now = float(model.out_scale.detach())
    assert now < -0.1  # it changed sign
    drift = mon.value("param_drift_log2", param="out_scale")
    assert drift == pytest.approx(math.log2(1 + abs(now - 1.0)), rel=1e-5)
    assert drift > 1.0 and param_drift(mon, "out_scale")
    mon.close()


def _segments_to(url: str, run: str, signs: tuple[float, ...], tmp_path) -> list[float]:
    """As _segments without the monitor's state, reporting to a collector: each segment's
    own drift (from its attach) at its end."""
    checkpoint = tmp_path / f"{run}.pt"
    drifts = []
    for seg, sign in enumerate(signs):
        model = Readout()
        opt = torch.optim.Adam(model.parameters(), lr=0.05, eps=1e-8)
        _biased_noise_hook(model, torch.Generator().manual_seed(7 + seg), sign=sign)
        if seg:
            saved = torch.load(checkpoint, weights_only=False)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
        mon = attach(model, opt, run=run, collector=url, every=10, signals=("params", "adam"))
        _train(model, opt, mon, seg * SEGMENT + 1, SEGMENT)
        drifts.append(mon.value("param_drift_log2", param="out_scale"))
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, checkpoint)
        assert mon.flush(60)
        mon.close()
    return drifts


def test_the_collector_judges_drift_over_a_resumed_runs_life(tmp_path):
    """Three segments resumed without the monitor's state: each drifts less than a bit
    from its own attach, more than a bit in all. The collector keeps the run's first
    references (in its state file) and pages ParamDrift; the twin whose segments drift
    back and forth stays quiet."""
    from tests.support import metric_value, running_collector, wait_until
    from trainvitals.monitor.settings import Settings

    with running_collector(Settings(state_path=tmp_path / "state.db")) as c:
        walked = _segments_to(c.url, "walk", (-1.0, -1.0, -1.0), tmp_path)
        assert all(0.0 < d < 1.0 for d in walked) and sum(walked) > 1.0, walked
        lifetime = metric_value(
            c.client.get("/metrics").text, "trainvitals_param_drift_lifetime_log2", run="walk", param="out_scale"
        )
        assert lifetime == pytest.approx(math.log2(2 ** walked[0] * 2 ** walked[1] * 2 ** walked[2]), rel=1e-4)
        wait_until(lambda: [a for a in c.alerts("walk") if a["alertname"] == "ParamDrift"], what="ParamDrift")
        # It fired (and resolved when the last segment closed: the run ended).
        (alert,) = [a for a in c.alerts("walk") if a["alertname"] == "ParamDrift"]
        assert alert["fired_at"] is not None and alert["labels"]["param"] == "out_scale", alert
        assert alert["fired_value"] > 1.0
        back = _segments_to(c.url, "back", (-1.0, 1.0, -1.0), tmp_path)
        assert all(abs(d) < 1.0 for d in back), back
        assert [a for a in c.alerts("back") if a["alertname"] == "ParamDrift"] == []
    # The references outlive the collector: a restarted one goes on judging the run's life.
    with running_collector(Settings(state_path=tmp_path / "state.db")) as c:
        assert c.app.state.lifetime.reference("walk", "out_scale") == pytest.approx(1.0, rel=1e-6)
