"""TRL's ``GRPOTrainer`` on its fused LM head with the Hugging Face callback
(``_grpo_job``): minus the gradient at a policy gradient's per-token log-probabilities is
weight x advantage, signed, not a cross-entropy's token weight. Every reported step whose
recorded "weights" include a negative one reads loss coverage inactive with the reason
``not_cross_entropy``; no report carries a loss-accounting figure; SignalInactive pages;
the close line and the verdict say why. (The healthy twin, TRL's SFTTrainer on the same
fused head, is ``test_trl``: active, its mass equal to the truth.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integrations._alerts import read_reports, run_script
from tests.integrations.test_zero_code import firing_alerts

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.slow  # a fresh Python importing torch, transformers and TRL

LOSS_FIGURES = {"loss", "loss_weight_mass", "token_weight_spread_ratio", "loss_accumulation_exponent", "microbatches"}


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    """24 optimizer steps of 4 completions (one group), reported every 4th (SignalInactive
    waits 20 steps)."""
    return run_script(HERE / "_grpo_job.py", tmp_path_factory.mktemp("grpo"), "steps=24", "every=4")


def test_grpo_signed_weights_are_withheld_with_the_reason(job):
    truth = {t["step"]: t for t in job["truth"]}
    assert sorted(truth) == list(range(1, 25)) and job["fused_forwards"] >= 24  # the fused head ran
    assert sum(t["negative"] for t in truth.values()) > 0  # the recorded "weights" are signed
    reports = read_reports(job["reports"])
    steps = [r for r in reports if r.get("coverage")][:-1]  # the last one is the close report
    assert [r["step"] for r in steps] == [1, 4, 8, 12, 16, 20, 24]
    for r in steps:
        loss = next(c for c in r["coverage"] if c["signal"] == "loss")
        if truth[r["step"]]["negative"]:
            assert loss["active"] is False and loss["reason"] == "not_cross_entropy", (r["step"], loss)
            assert "signed per-token weights" in loss["detail"] and "policy gradient" in loss["detail"]
            assert "loss_not_cross_entropy" in {e["kind"] for e in r.get("events", [])}
        else:
            assert loss["active"] is True, (r["step"], loss)
    end = next(c for c in reports[-1]["coverage"] if c["signal"] == "loss")  # the close report's
    assert end["active"] is False and end["reason"] == "not_cross_entropy", end
    emitted = {s["name"] for r in reports for s in r.get("samples", [])}
    assert not emitted & LOSS_FIGURES, emitted & LOSS_FIGURES
    inactive = {
        (a.labels.get("signal"), a.labels.get("reason"))
        for a in firing_alerts(reports)
        if a.rule.alert == "SignalInactive"
    }
    assert ("loss", "not_cross_entropy") in inactive, inactive
    close = [line for line in job["log"] if "closed after 24 optimizer step(s)" in line]
    assert len(close) == 1 and "never engaged: loss (not_cross_entropy: " in close[0], close
    assert "signed per-token weights" in close[0]
    verdict = [line for line in job["log"] if "verdict for run grpo" in line]
    assert len(verdict) == 1 and "not checked: loss (not a plain cross-entropy loss)" in verdict[0], verdict
