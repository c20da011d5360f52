"""TRL's RL trainers read for what their objective is (``_rl_job``): on ``GRPOTrainer``
(every ``loss_type`` of the pinned release) and ``RLOOTrainer`` the normalization weights
are read at the trainer's policy loss, apart from the advantages, so the weight mass,
accumulation exponent and spread equal the truth the job measures by autograd in its own
backward (the gradient at the per-token log-probabilities over the advantage), or are
withheld with a reason; every stock loss type stays silent for 25 steps. The write-up's
DAPO (a ``GRPOTrainer`` subclass whose ``compute_loss`` skips ``/
gradient_accumulation_steps``) is flagged at 4 with accumulation 4 by the callback
(through a collector and through the local file), by ``trainvitals run`` and by
``trainvitals check -- CMD``, which exits non-zero; its fix is silent."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integrations._alerts import LOSS_RULES, figures, read_reports, run_script
from tests.integrations.test_zero_code import firing_alerts
from tests.support import metric_value, running_collector

HERE = Path(__file__).resolve().parent
JOB = HERE / "_rl_job.py"
ACCUM = 4
STEPS = 25

pytestmark = pytest.mark.slow  # fresh Pythons importing torch, transformers and TRL, 100 micro-batches each

WITHHELD = {"dr_grpo", "luspo"}  # scaled on purpose: coverage objective_scaled
PER_SAMPLE = {"grpo", "sapo", "bnpo"}  # a mean over each sequence's / micro-batch's own tokens: intended
LOSS_FIGURES = {"loss_weight_mass", "loss_accumulation_exponent", "token_weight_spread_ratio"}


def _loss_coverage(report: dict) -> dict:
    return next(c for c in report["coverage"] if c["signal"] == "loss")


def _truth_spread(step: dict, per_sample: bool = False) -> float | None:
    """Max over min per-token weight across the step's micro-batches, when each micro-batch
    weighs its label tokens equally (else there is no spread to report); under a declared
    per-sample intent, whether they do or not."""
    micro = step["micro"]
    if not per_sample and not all(m["wmax"] <= m["wmin"] * (1 + 1e-3) for m in micro):
        return None
    return max(m["wmax"] for m in micro) / min(m["wmin"] for m in micro)


def _job(tmp_path: Path, *options: str) -> dict:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return run_script(JOB, tmp_path, f"steps={STEPS}", f"accum={ACCUM}", "every=4", *options)


@pytest.mark.parametrize("kind", ["grpo", "dapo", "bnpo", "dr_grpo", "cispo", "sapo", "vespo", "luspo", "rloo"])
def test_stock_objectives_read_exactly_or_withheld_and_silent(tmp_path: Path, kind: str):
    options = ("trainer=rloo",) if kind == "rloo" else (f"loss_type={kind}",)
    job = _job(tmp_path, *options)
    assert job["min_abs_advantage"] > 1e-4  # the truth divides by every advantage
    truth = {t["step"]: t for t in job["truth"]}
    assert sorted(truth) == list(range(1, STEPS + 1))
    assert all(len(t["micro"]) == ACCUM for t in truth.values())
    reports = read_reports(job["reports"])
    stepped = [r for r in reports if r.get("coverage")][:-1]  # the last one is the close report
    assert [r["step"] for r in stepped] == [1, 4, 8, 12, 16, 20, 24]
    mass = figures(reports, "loss_weight_mass", objective="main")
    exponent = figures(reports, "loss_accumulation_exponent", objective="main")
    spread = figures(reports, "token_weight_spread_ratio", objective="main")
    # per-sample intent: the spread reported as that intent, which MeanOfMeansLoss skips
    intended = figures(reports, "token_weight_spread_ratio", objective="main", normalization="sample")
    if kind in WITHHELD:
        emitted = {s["name"] for r in reports for s in r.get("samples", [])}
        assert not emitted & LOSS_FIGURES, emitted & LOSS_FIGURES
        for r in reports:
            loss = _loss_coverage(r)
            assert loss["active"] is False and loss["reason"] == "objective_scaled", loss
            assert f"loss_type {kind!r}" in loss["detail"]
        # What the figures would have said: not 1, by design.
        assert any(abs(t["mass"] - 1) > 0.02 for t in truth.values())
    else:
        for r in stepped:
            step, t = r["step"], truth[r["step"]]
            assert _loss_coverage(r)["active"] is True, r["step"]
            assert mass[step] == pytest.approx(t["mass"], rel=0.01), step
            assert exponent[step] == pytest.approx(math.log(t["mass"]) / math.log(ACCUM), abs=0.01), step
            expected = None if kind in PER_SAMPLE else _truth_spread(t)
            if expected is None:
                assert step not in spread, (step, spread.get(step))
            else:
                assert spread[step] == pytest.approx(expected, rel=0.01), step
            if kind in PER_SAMPLE:  # completions of different lengths: a spread above MeanOfMeansLoss's line
                assert intended[step] == pytest.approx(_truth_spread(t, per_sample=True), rel=0.01), step
            else:
                assert step not in intended, (step, intended.get(step))
        if kind in PER_SAMPLE:  # grpo/sapo: completions 1-8 tokens long; bnpo: micro-batch token counts
            assert max(intended.values()) > (1.0 if kind == "bnpo" else 1.25), intended
        assert mass and all(abs(v - 1) < 0.01 for v in mass.values())  # TRL's stock types normalize: 1
    fired = {a.rule.alert for a in firing_alerts(reports)}
    assert not fired & (LOSS_RULES | {"SignalInactive"}), fired


def test_a_step_without_a_negative_advantage_is_still_read_as_a_policy_gradient(tmp_path: Path):
    """Every reward equal: every advantage zero, so the gradient at the log-probabilities
    is zero and no "weight" is negative: the sign alone would take it for a cross-entropy
    of weight mass 0. The trainer says what it is: GRPO's weights (each sequence averaged
    over its own tokens, 4 sequences, divided by 4 micro-batches) sum to 1."""
    job = run_script(JOB, tmp_path, "steps=6", f"accum={ACCUM}", "every=2", "loss_type=grpo", "reward=flat")
    assert job["min_abs_advantage"] == 0.0
    reports = read_reports(job["reports"])
    mass = figures(reports, "loss_weight_mass", objective="main")
    assert sorted(mass) == [1, 2, 4, 6] and all(v == pytest.approx(1.0, rel=1e-3) for v in mass.values()), mass
    for r in reports:
        assert _loss_coverage(r)["active"] is True
        assert "loss_not_cross_entropy" not in {e["kind"] for e in r.get("events", [])}


def test_writeup_dapo_flagged_through_the_callback_and_its_fix_silent(tmp_path: Path):
    """Through a collector (its alerts and /metrics) and through the local file."""
    with running_collector() as collector:
        bug = _job(tmp_path / "bug", "loss_type=dapo", "variant=bug", f"collector={collector.url}")
        alert = collector.wait_for("LossNotAccumNormalized", "rl", state="resolved")  # the run's end resolves it
        assert alert["labels"]["objective"] == "main"
        assert float(metric_value(collector.metrics(), "trainvitals_loss_weight_mass", run="rl", objective="main")) == (
            pytest.approx(4.0, rel=0.01)
        )
    for t in bug["truth"]:
        assert t["mass"] == pytest.approx(4.0, rel=1e-4)  # the truth: N, the division missing
    local = _job(tmp_path / "local", "loss_type=dapo", "variant=bug")
    reports = read_reports(local["reports"])
    truth = {t["step"]: t["mass"] for t in local["truth"]}
    mass = figures(reports, "loss_weight_mass", objective="main")
    exponent = figures(reports, "loss_accumulation_exponent", objective="main")
    assert mass and all(v == pytest.approx(truth[s], rel=0.01) for s, v in mass.items())
    assert all(v == pytest.approx(1.0, abs=0.01) for v in exponent.values())
    assert "LossNotAccumNormalized" in {a.rule.alert for a in firing_alerts(reports)}

    fixed = _job(tmp_path / "fixed", "loss_type=dapo", "variant=fixed")
    reports = read_reports(fixed["reports"])
    mass = figures(reports, "loss_weight_mass", objective="main")
    assert mass and all(v == pytest.approx(1.0, rel=0.01) for v in mass.values())
    assert all(t["mass"] == pytest.approx(1.0, rel=1e-4) for t in fixed["truth"])
    fired = {a.rule.alert for a in firing_alerts(reports)}
    assert not fired & (LOSS_RULES | {"SignalInactive"}), fired


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINVITALS_")}
    env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "trainvitals.monitor.cli", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _command(tmp_path: Path, variant: str) -> list[str]:
    out = tmp_path / f"{variant}.json"
    return [sys.executable, str(JOB), str(out), "loss_type=dapo", f"variant={variant}", "callback=0", "steps=40"]


def test_writeup_dapo_flagged_by_trainvitals_run(tmp_path: Path):
    done = _cli(tmp_path, "run", "--run", "dapo", "--every", "4", "--", *_command(tmp_path, "bug"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "a subclass with its own compute_loss" in done.stderr
    reports = read_reports(tmp_path / "trainvitals-dapo.jsonl")
    truth = {t["step"]: t["mass"] for t in json.loads((tmp_path / "bug.json").read_text())["truth"]}
    mass = figures(reports, "loss_weight_mass", objective="main")
    assert len(mass) >= 8 and all(v == pytest.approx(truth[s], rel=0.01) and v > 3.9 for s, v in mass.items())
    assert "LossNotAccumNormalized" in {a.rule.alert for a in firing_alerts(reports)}


def test_writeup_dapo_check_exits_non_zero_and_its_fix_passes(tmp_path: Path):
    done = _cli(tmp_path, "check", "--steps", str(STEPS), "--run", "dapo", "--", *_command(tmp_path, "bug"))
    assert done.returncode == 1, done.stdout + done.stderr[-4000:]
    assert "LossNotAccumNormalized {objective=main}: fired at step" in done.stdout
    assert "peak 4:" in done.stdout
    assert "  loss: active in 24 of 25 reports" in done.stdout  # attached at the first step: from the second
    done = _cli(
        tmp_path, "check", "--steps", str(STEPS), "--run", "fixed", "--json", "--", *_command(tmp_path, "fixed")
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    (run,) = json.loads(done.stdout)["runs"]
    assert run["incidents"] == [] and run["signals"]["loss"]["active"] == 24


def test_preference_loss_is_withheld_never_a_cross_entropy_weight_mass(tmp_path: Path):
    """TRL's ``DPOTrainer`` (``_dpo_job``): loss coverage inactive, ``not_cross_entropy``,
    naming the preference loss, in every report; no loss-accounting figure at all."""
    job = run_script(HERE / "_dpo_job.py", tmp_path, "steps=8", "every=2")
    reports = read_reports(job["reports"])
    assert [r["step"] for r in reports if r.get("coverage")] == [1, 2, 4, 6, 8, 8]
    for r in reports:
        loss = _loss_coverage(r)
        assert loss["active"] is False and loss["reason"] == "not_cross_entropy", loss
        assert loss["detail"].startswith("DPOTrainer: a preference loss"), loss
    emitted = {s["name"] for r in reports for s in r.get("samples", [])}
    assert not emitted & (LOSS_FIGURES | {"loss", "microbatches"}), emitted
    assert any("DPOTrainer: loss figures withheld" in line for line in job["log"]), job["log"]
    close = [line for line in job["log"] if "closed after 8 optimizer step(s)" in line]
    assert len(close) == 1 and "never engaged: loss (not_cross_entropy: DPOTrainer: a preference loss" in close[0]
