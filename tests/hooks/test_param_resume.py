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
