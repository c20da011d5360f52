"""``trainvitals run`` over a nanoGPT-style script (jobs/nanogpt.py: 65 tokens, 256
positions, a tied head, gradient accumulation 4): the head is found by what it is
(tied to the token embedding; not the largest embedding, the position table), and the
figures equal the true per-token weights the job measured with autograd. Without its
``/ gradient_accumulation_steps`` LossNotAccumNormalized fires; with it nothing does."""

from __future__ import annotations

import sys

import pytest

from tests.integrations._alerts import LOSS_RULES, figures, firing, read_reports
from tests.run_configure._helpers import JOBS, job_env, printed, trainvitals

pytestmark = pytest.mark.slow  # each job is a fresh Python that imports torch

STEPS = 24  # LossNotAccumNormalized needs 20 reported steps in a row


@pytest.mark.parametrize("width", [32, 64], ids=["width32", "width64-mlp-sized-like-positions"])
@pytest.mark.parametrize("undivided", [True, False], ids=["missing-division", "healthy"])
def test_nanogpt_style_script_is_accounted_against_its_true_weights(tmp_path, undivided, width):
    out = tmp_path / "reports.jsonl"
    cmd = [sys.executable, str(JOBS / "nanogpt.py"), "--steps", str(STEPS), "--width", str(width)]
    if undivided:
        cmd.append("--undivided")
    proc = trainvitals(
        "run", "--run", "nanogpt", "--collector", f"file:{out}", "--every", "1", "--", *cmd, env=job_env(), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "loss accounting from the logits of 'lm_head'" in proc.stderr
    reports = read_reports(out)
    mass = figures(reports, "loss_weight_mass", objective="main")
    exponent = figures(reports, "loss_accumulation_exponent", objective="main")
    # Attached at the first step's pre-step hook: figures from step 2 on, every step.
    assert sorted(mass) == list(range(2, STEPS + 1))
    for step in range(2, STEPS + 1):
        assert mass[step] == pytest.approx(printed(proc.stdout, step, "mass"), rel=1e-5)
        spread = printed(proc.stdout, step, "wmax") / printed(proc.stdout, step, "wmin")
        got = figures(reports, "token_weight_spread_ratio", objective="main").get(step)
        assert got == pytest.approx(spread, rel=1e-4)
        assert exponent[step] == pytest.approx(1.0 if undivided else 0.0, abs=1e-5)
    assert mass[STEPS] == pytest.approx(4.0 if undivided else 1.0, rel=1e-5)
    fired = firing(reports) & LOSS_RULES
    assert fired == ({"LossNotAccumNormalized"} if undivided else set())
    assert "not a plain cross-entropy" not in proc.stderr
