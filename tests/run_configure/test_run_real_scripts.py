"""``trainvitals run`` over scripts written as their frameworks' users write them.

A nanoGPT-style script (jobs/nanogpt.py: 65 tokens, 256 positions, a tied head,
gradient accumulation 4): the head is found by what it is (tied to the token
embedding; not the largest embedding, the position table), and the figures equal the
true per-token weights the job measured with autograd. Without its
``/ gradient_accumulation_steps`` LossNotAccumNormalized fires; with it nothing does.
A LLaVA loop that tags nothing (jobs/llava_loop.py): image samples found by the model's
image token."""

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


def test_a_vlm_loop_under_trainvitals_run_classes_samples_by_the_image_token(tmp_path):
    """jobs/llava_loop.py tags nothing: the model's config names its image token, so its
    image samples are found by their input ids; the image share of the gradient equals
    the truth the job measured (an image sample being one with pixel values)."""
    out = tmp_path / "reports.jsonl"
    proc = trainvitals(
        "run",
        "--run",
        "llava",
        "--collector",
        f"file:{out}",
        "--every",
        "1",
        "--",
        sys.executable,
        str(JOBS / "llava_loop.py"),
        env=job_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "samples are classed as text, image by their input ids" in proc.stderr
    reports = read_reports(out)
    share = figures(reports, "modality_grad_share_ratio", modality="image")
    samples = figures(reports, "modality_sample_share_ratio", modality="image")
    assert sorted(share) == [2, 3, 4]  # attached at step 1's optimizer step
    for step in (2, 3, 4):
        assert share[step] == pytest.approx(printed(proc.stdout, step, "image_share"), rel=1e-5)
        assert share[step] == pytest.approx(2 / 31, rel=1e-5)  # 1 label token of 1 + 29 per pair
        assert samples[step] == 0.5
