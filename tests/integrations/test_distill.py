"""TRL's distillation trainers with the Hugging Face callback and no other trainvitals
code (``_distill_job``): ``DistillationTrainer`` (its fused divergence kernel never
materializes logits) and ``GKDTrainer`` (``generalized_jsd_loss`` on both models'
logits). Every reported I5 figure, for the student and the teacher at the temperature
the loss uses, equals the truth computed in the job from the models' full logits over
the positions the loss counts (the recommended temperature within 2%); a sharp teacher
at temperature 1 fires SoftmaxSaturation, its twin at 8 (``DistillationTrainer``) or a
soft teacher (``GKDTrainer``, whose loss ignores ``GKDConfig.temperature``) stays
silent; the divergence is never read as a cross-entropy: loss accounting is withheld as
``not_cross_entropy`` at start, in every report, at close, in the verdict and on
``/metrics``. Through the local file, ``trainvitals check FILE``, ``trainvitals check --
CMD`` and a real collector."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.integrations._alerts import figures, firing, read_reports, run_script
from tests.support import metric_value, running_collector
from trainvitals.monitor.cli import main

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.slow  # fresh Pythons importing torch, transformers and TRL, 60 steps a job

STEPS, EVERY, ACCUM = 60, 5, 2
REPORTED = [1, *range(EVERY, STEPS + 1, EVERY)]
LOSS_FIGURES = {"loss", "loss_weight_mass", "token_weight_spread_ratio", "loss_accumulation_exponent", "microbatches"}
JOBS = ("distill:sharp:1", "distill:sharp:8", "gkd:sharp:1", "gkd:soft:1", "gkd:sharp:8")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, dict]:
    """Every job in one fresh Python (TRL imported once), 60 optimizer steps of two
    micro-batches of four completions, reported every 5th: job -> its result."""
    return run_script(
        HERE / "_distill_job.py",
        tmp_path_factory.mktemp("distill"),
        f"jobs={','.join(JOBS)}",
        f"steps={STEPS}",
        f"every={EVERY}",
    )


def check_against_truth(result: dict) -> list[dict]:
    """Every I5 figure of every report against the job's truth; the reports."""
    reports = read_reports(result["reports"])
    truth = {int(step): t for step, t in result["truth"].items()}
    assert sorted(truth) == REPORTED
    assert result["observed"] == ACCUM * len(REPORTED)  # each micro-batch of each reported step
    for role in ("student", "teacher"):
        series = {
            "top1": figures(reports, "softmax_top1_prob_mean", task="all", role=role),
            "sat99": figures(reports, "softmax_saturated_ratio", task="all", role=role, threshold="0.99"),
            "sat999": figures(reports, "softmax_saturated_ratio", task="all", role=role, threshold="0.999"),
            "jacobian": figures(reports, "softmax_jacobian_mean", task="all", role=role),
            "entropy": figures(reports, "softmax_entropy_nats", task="all", role=role),
            "recommended": figures(reports, "softmax_recommended_temperature", task="all", role=role),
        }
        for name, got in series.items():
            assert sorted(got) == REPORTED, (role, name, sorted(got))
            for step in REPORTED:
                want = truth[step][role][name]
                tolerance = pytest.approx(want, rel=0.02) if name == "recommended" else pytest.approx(want, abs=2e-5)
                assert got[step] == tolerance, (role, name, step, got[step], want)
    share = figures(reports, "distill_top1_grad_share_ratio", task="all")
    dark = figures(reports, "distill_dark_knowledge_mass", task="all")
    for step in REPORTED:
        assert share[step] == pytest.approx(truth[step]["share"], abs=2e-5), step
        assert dark[step] == pytest.approx(truth[step]["dark"], abs=2e-5), step
    return reports


def assert_loss_withheld(result: dict, trainer: str, divergence: str) -> None:
    """Not a cross-entropy: said at start, in every report, at close and in the verdict;
    no loss-accounting figure anywhere."""
    reports = read_reports(result["reports"])
    for r in reports:
        loss = next(c for c in r["coverage"] if c["signal"] == "loss")
        assert loss["active"] is False and loss["reason"] == "not_cross_entropy", (r["step"], loss)
        assert f"TRL {trainer}: the loss is the {divergence}" in loss["detail"], loss["detail"]
    emitted = {s["name"] for r in reports for s in r.get("samples", [])}
    assert not emitted & LOSS_FIGURES, emitted & LOSS_FIGURES
    run, log = result["run"], result["log"]
    (start,) = [line for line in log if line.startswith(f"trainvitals: run '{run}'") and "reports every" in line]
    assert "blind: loss (not_cross_entropy: " in start and divergence in start, start
    (close,) = [line for line in log if f"closed after {STEPS} optimizer step(s)" in line]
    assert f"softmax ({len(REPORTED)} report(s))" in close, close
    assert "never engaged: loss (not_cross_entropy: " in close, close
    (verdict,) = [line for line in log if f"verdict for run {run}" in line]
    assert "not checked: loss (not a plain cross-entropy loss)" in verdict, verdict


def test_distillation_trainer_saturated_teacher_at_tau_1_fires_with_the_true_figures(jobs):
    result = jobs["distill:sharp:1"]
    assert result["loss_tau"] == 1.0
    reports = check_against_truth(result)
    truth = result["truth"]
    assert min(t["teacher"]["sat99"] for t in truth.values()) > 0.9  # the incident: a near one-hot teacher
    assert min(t["share"] for t in truth.values()) > 0.99  # everything taught is "more of the top-1"
    assert "SoftmaxSaturation" in firing(reports)
    assert_loss_withheld(result, "DistillationTrainer", "reverse KL(student || teacher)")
    assert any("observed at temperature 1, the loss's" in line for line in result["log"])


def test_distillation_trainer_the_same_teacher_at_tau_8_is_silent(jobs):
    result = jobs["distill:sharp:8"]
    assert result["loss_tau"] == 8.0
    reports = check_against_truth(result)
    assert max(t["teacher"]["sat99"] for t in result["truth"].values()) < 0.05
    assert "SoftmaxSaturation" not in firing(reports)
    assert_loss_withheld(result, "DistillationTrainer", "reverse KL(student || teacher)")


def test_gkd_trainer_saturated_teacher_fires_and_a_soft_teacher_is_silent(jobs):
    sharp, soft = jobs["gkd:sharp:1"], jobs["gkd:soft:1"]
    assert "SoftmaxSaturation" in firing(check_against_truth(sharp))
    assert "SoftmaxSaturation" not in firing(check_against_truth(soft))
    assert max(t["teacher"]["sat99"] for t in soft["truth"].values()) == 0
    for result in (sharp, soft):
        assert_loss_withheld(result, "GKDTrainer", "generalized JSD (beta=0.5)")


def test_gkd_config_temperature_is_not_the_loss_temperature_and_is_said(jobs):
    """``GKDTrainer.compute_loss`` ignores ``GKDConfig.temperature`` (it sets sampling): the
    loss compares the distributions at 1, so the sharp teacher still fires, and a line
    says why."""
    result = jobs["gkd:sharp:8"]
    assert result["loss_tau"] == 1.0
    assert "SoftmaxSaturation" in firing(check_against_truth(result))
    assert any("GKDConfig(temperature=8) sets the sampling temperature only" in line for line in result["log"])


def test_a_gkd_subclass_with_its_own_loss_temperature_is_not_observed_and_says_why(tmp_path):
    """A ``compute_loss`` of the job's own sets the loss's temperature: it cannot be read,
    so the distributions are not observed (never at a guessed temperature), and the
    coverage and the log say why; the loss stays withheld."""
    result = run_script(HERE / "_distill_job.py", tmp_path, "jobs=gkd-own:sharp:8", "steps=6", f"every={EVERY}")
    job = result["gkd-own:sharp:8"]
    assert job["observed"] == 0
    reports = read_reports(job["reports"])
    for r in reports:
        softmax = next(c for c in r["coverage"] if c["signal"] == "softmax")
        assert softmax["active"] is False and "overrides GKDTrainer.compute_loss" in softmax["detail"], softmax
        loss = next(c for c in r["coverage"] if c["signal"] == "loss")
        assert loss["reason"] == "not_cross_entropy", loss
    assert not {s["name"] for r in reports for s in r.get("samples", [])} & {"softmax_top1_prob_mean"}
    assert any("the distillation's distributions are not observed" in line for line in job["log"]), job["log"]


def _check(*args: str) -> tuple[int, str]:
    done = CliRunner().invoke(main, ["check", *args])
    return done.exit_code, done.output


def test_check_on_the_local_files_names_the_saturated_teacher_only(jobs):
    code, out = _check(jobs["distill:sharp:1"]["reports"])
    (line,) = [line for line in out.splitlines() if "SoftmaxSaturation" in line]
    assert code == 1 and "task=all, role=teacher, threshold=0.99" in line and "firing" in line, out
    assert "reason=not_cross_entropy" in out and "distillation loss" in out, out
    code, out = _check(jobs["distill:sharp:8"]["reports"])
    assert "SoftmaxSaturation" not in out, out
    # the healthy twin is still told that loss accounting does not apply to its loss
    assert "SignalInactive" in out and "reason=not_cross_entropy" in out, out
    assert _check("--fail-on", "page", jobs["distill:sharp:8"]["reports"])[0] == 0


def test_check_command_on_a_job_without_trainvitals_names_the_saturated_teacher(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINVITALS_")}
    script = [sys.executable, str(HERE / "_distill_job.py"), str(tmp_path / "r.json"), f"steps={STEPS}"]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainvitals.monitor.cli",
            "check",
            "--steps",
            str(STEPS),
            "--",
            *script,
            "jobs=distill:sharp:1",
            "callback=0",  # no trainvitals code in the job: trainvitals run attaches
        ],
        cwd=tmp_path,
        env={**env, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 1, done.stdout + done.stderr[-4000:]
    (line,) = [line for line in done.stdout.splitlines() if "SoftmaxSaturation" in line]
    assert "task=all, role=teacher, threshold=0.99" in line and "firing" in line, done.stdout
    assert "loss: NOT WATCHED: not_cross_entropy: TRL DistillationTrainer" in done.stdout, done.stdout
    # trainvitals run attaches at the first optimizer step, after that step's forwards
    assert "softmax: active in 59 of 60 reports" in done.stdout, done.stdout


def test_through_a_collector_metrics_say_loss_withheld_and_the_alert_fires(tmp_path):
    with running_collector() as c:
        result = run_script(
            HERE / "_distill_job.py",
            tmp_path,
            "jobs=distill:sharp:1,distill:sharp:8",
            f"steps={STEPS}",
            f"every={EVERY}",
            f"collector={c.url}",
        )
        text = c.metrics()
        alerts = c.alerts()
    for name, job in result.items():
        run = job["run"]
        assert metric_value(text, "trainvitals_signal_active", run=run, signal="loss", reason="not_cross_entropy") == 0
        assert metric_value(text, "trainvitals_signal_active", run=run, signal="softmax") == 1
        last = job["truth"][str(STEPS)]["teacher"]
        got = metric_value(text, "trainvitals_softmax_top1_prob_mean", run=run, task="all", role="teacher")
        assert got == pytest.approx(last["top1"], abs=2e-5), name
        assert metric_value(text, "trainvitals_loss_weight_mass", run=run, objective="main") is None
        fired = {a["alertname"] for a in alerts if a["labels"].get("run") == run}
        assert ("SoftmaxSaturation" in fired) == (name == "distill:sharp:1"), (name, fired)
