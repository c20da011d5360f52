"""TRL's ``GRPOTrainer`` on its fused LM head with the Hugging Face callback
(``_grpo_job``): minus the gradient at a policy gradient's per-token log-probabilities is
weight x advantage, signed, not a cross-entropy's token weight. The callback identifies
the trainer and reads the weights at its policy loss instead (``integrations_rl``): every
reported step is active with weight mass 1 (GRPO's per-sequence mean, one micro-batch),
no step is read as a signed cross-entropy, nothing fires. (Every loss type, RLOO,
accumulation and the write-up's DAPO: ``test_rl_objectives``.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integrations._alerts import LOSS_RULES, figures, read_reports, run_script
from tests.integrations.test_zero_code import firing_alerts

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.slow  # a fresh Python importing torch, transformers and TRL


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    """24 optimizer steps of 4 completions (one group), reported every 4th (SignalInactive
    waits 20 steps)."""
    return run_script(HERE / "_grpo_job.py", tmp_path_factory.mktemp("grpo"), "steps=24", "every=4")


def test_grpo_signed_gradient_is_read_apart_from_the_advantages(job):
    truth = {t["step"]: t for t in job["truth"]}
    assert sorted(truth) == list(range(1, 25)) and job["fused_forwards"] >= 24  # the fused head ran
    assert sum(t["negative"] for t in truth.values()) > 0  # the gradient at the log-probs is signed
    reports = read_reports(job["reports"])
    steps = [r for r in reports if r.get("coverage")][:-1]  # the last one is the close report
    assert [r["step"] for r in steps] == [1, 4, 8, 12, 16, 20, 24]
    for r in steps:
        loss = next(c for c in r["coverage"] if c["signal"] == "loss")
        assert loss["active"] is True, (r["step"], loss)
        assert "loss_not_cross_entropy" not in {e["kind"] for e in r.get("events", [])}
    mass = figures(reports, "loss_weight_mass", objective="main")
    assert sorted(mass) == [1, 4, 8, 12, 16, 20, 24]
    assert all(v == pytest.approx(1.0, rel=1e-3) for v in mass.values()), mass
    fired = {a.rule.alert for a in firing_alerts(reports)}
    assert not fired & (LOSS_RULES | {"SignalInactive"}), fired
    assert any("GRPOTrainer (loss_type" in line and "read at its policy loss" in line for line in job["log"])
    verdict = [line for line in job["log"] if "verdict for run grpo" in line]
    assert len(verdict) == 1 and "checked: optimizer, params, adam, loss;" in verdict[0], verdict
