"""Local-first diagnosis: a job with no collector says what fired, with its step, and a
verdict at close; ``trainvitals check`` judges recorded files and pre-flights a script.

Real jobs (tests/e2e/_jobs.py) write real report files; ``check`` runs as the CLI
(``CliRunner`` for files, a real subprocess for the pre-flight check, which starts the
job under ``trainvitals run``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.e2e._jobs import DilutionJob
from tests.local._recorded import record
from trainvitals.hooks import attach
from trainvitals.monitor.cli import main

SCRIPT = Path(__file__).parent / "scripts" / "train_accum.py"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("recorded")
    return {name: record(folder, name) for name in ("i2", "i3", "i4", "i5", "healthy")}


def _check(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["check", *args])
    return result.exit_code, result.output


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "trainvitals"]


# -- the job itself, no collector ------------------------------------------------------------


@pytest.mark.parametrize("fixed", [False, True], ids=["I1", "healthy-twin"])
def test_a_job_without_collector_logs_the_firing_step_and_a_verdict_at_close(
    fixed: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    monkeypatch.chdir(tmp_path)  # the default report file lands here
    job = DilutionJob(fixed=fixed)
    with caplog.at_level(logging.INFO, logger="trainvitals"):
        mon = attach(job.model, job.opt, run="i1", modalities=job.modalities, every=1)  # no collector, no rules=
        job.train(mon, 30)
        mon.close()
    messages = _messages(caplog)
    alerts = [m for m in messages if m.startswith("trainvitals alert ")]
    (verdict,) = [m for m in messages if m.startswith("trainvitals verdict ")]
    assert (tmp_path / "trainvitals-i1.jsonl").is_file()
    if fixed:
        assert alerts == []
        assert verdict == (
            "trainvitals verdict for run i1: no incident in 31 reports (steps 1-30); checked: optimizer, params, "
            "adam, loss; not checked: probe (not requested), softmax (not requested); reports in trainvitals-i1.jsonl"
        )
        return
    # One line per transition: the alert, the step, the value, the summary; the run's end resolves it.
    assert alerts[0] == (
        "trainvitals alert GradientDilution firing at step 21 (value 16.96): Run i1, step 21: image samples get "
        "17.0x less gradient than the job's intended loss normalization gives them; check how the loss is "
        "normalized (per token instead of per sample?) {run=i1, modality=image} "
        "runbook: RUNBOOKS.md#gradientdilution"
    )
    assert len(alerts) == 2 and alerts[1].startswith(
        "trainvitals alert Resolved: GradientDilution in run i1 (modality=image): run i1 ended at step 30 after firing"
    )
    lines = verdict.splitlines()
    assert lines[0] == (
        "trainvitals verdict for run i1: 1 incident(s), 1 of severity page in 31 reports (steps 1-30); "
        "checked: optimizer, params, adam, loss; not checked: probe (not requested), softmax (not requested); "
        "reports in trainvitals-i1.jsonl"
    )
    assert lines[1].startswith(
        "  PAGE GradientDilution {modality=image}: fired at step 21, still firing when the run ended at step 30, "
        "peak 16.96: "
    )
    assert lines[2].startswith("    what to do: Normalize per sample")
    assert mon.verdict().paged


def test_a_resolution_is_logged_with_its_step(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    job = DilutionJob()
    with caplog.at_level(logging.INFO, logger="trainvitals"):
        mon = attach(
            job.model, job.opt, run="r", sink=f"file:{tmp_path / 'r.jsonl'}", modalities=job.modalities, every=1
        )
        job.train(mon, 24)
        job.fixed = True  # the fix, mid-run: the dilution clears at once (clear 3, no hold)
        job.train(mon, 3)
        mon.close()
    alerts = [m for m in _messages(caplog) if m.startswith("trainvitals alert ")]
    assert len(alerts) == 2
    assert alerts[1].startswith(
        "trainvitals alert Resolved: GradientDilution in run r (modality=image) at step 25: "
        "modality_excess_dilution_ratio is back to "
    )
    assert alerts[1].endswith("it fired at 16.96")
    verdict = mon.verdict()
    (incident,) = verdict.incidents
    assert (incident.first_step, incident.last_step, incident.resolved) == (21, 25, True)


def test_in_job_rules_run_with_a_collector_too_and_are_off_when_turned_off(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where reports the collector never takes are kept
    job = DilutionJob()
    with attach(job.model, job.opt, run="a", collector="http://127.0.0.1:9", every=1, flush_timeout=0.1) as mon:
        assert mon.verdict() is not None  # the job says each alert as it fires, collector or not
    for off in ("off", "none", False):
        with attach(job.model, job.opt, run="b", sink="null", rules=off) as mon:
            assert mon.verdict() is None
    with attach(job.model, job.opt, run="c", sink="null") as mon:
        assert mon.verdict() is not None  # no collector: the default rules


def test_run_accepts_set_rules_and_modalities(monkeypatch: pytest.MonkeyPatch):
    from trainvitals.monitor.cli_run import job_environment

    env = job_environment("r", None, None, None, ("rules=default", "modalities=text,image"), ("python", "x.py"), {})
    assert env["TRAINVITALS_LOCAL_RULES"] == "default"
    assert env["TRAINVITALS_MODALITIES"] == "text,image"
    result = CliRunner().invoke(main, ["run", "--set", "nope=1", "--", "true"])
    assert result.exit_code == 1 and "rules" in result.output and "modalities" in result.output


# -- check over recorded files ----------------------------------------------------------------


def test_check_tables_i2_to_i5_with_their_values(recorded: dict[str, Path]):
    code, out = _check(*(str(recorded[n]) for n in ("i2", "i3", "i4", "i5")))
    assert code == 1  # I2 and I4 page
    rows = {tuple(line.split()[:8]) for line in out.splitlines()[1:]}
    assert ("i2", "LossNotAccumNormalized", "page", "objective=main", "21", "24", "4", "firing") in rows
    assert ("i3", "MeanOfMeansLoss", "warning", "objective=main", "51", "54", "3", "firing") in rows
    assert ("i4", "ParamDrift", "page", "param=scale", "36", "56", "1.989", "firing") in rows
    assert ("i4", "AdamEpsilonDominated", "warning", "param=scale", "51", "56", "1", "firing") in rows
    assert re.search(
        r"^i5\s+SoftmaxSaturation\s+warning\s+task=ie, role=teacher, threshold=0.99\s+51\s+54\s+1\s+firing", out, re.M
    )
    assert "Divide each micro-batch loss by the accumulation count" in out  # what to do

    code, out = _check("--json", str(recorded["i2"]), str(recorded["i3"]))
    runs = {r["run"]: r for r in json.loads(out)["runs"]}
    (i2,) = runs["i2"]["incidents"]
    assert (i2["alert"], i2["first_step"], i2["last_step"], i2["peak"]) == ("LossNotAccumNormalized", 21, 24, 4.0)
    (i3,) = runs["i3"]["incidents"]
    assert i3["peak"] == pytest.approx(3.0) and runs["i3"]["paged"] is False


def test_check_exit_codes(recorded: dict[str, Path], tmp_path: Path):
    assert _check(str(recorded["i2"]))[0] == 1  # a page fired
    code, out = _check(str(recorded["i3"]))
    assert code == 1 and "MeanOfMeansLoss  warning" in out  # a warning: --fail-on warning, the default
    assert _check("--fail-on", "page", str(recorded["i3"]))[0] == 0  # a warning only
    code, out = _check(str(recorded["healthy"]))
    assert (code, out.strip()) == (
        0,
        "healthy: no incident in 31 reports (steps 1-30); checked: optimizer, params, adam, loss, softmax; "
        "not checked: probe (not requested)",
    )
    bad = tmp_path / "bad.jsonl"
    lines = recorded["healthy"].read_text().splitlines()
    bad.write_text("\n".join([lines[0], lines[1], '{"run": "x", "step": -1}', *lines[3:]]) + "\n")
    code, out = _check(str(bad))
    assert code == 2 and f"{bad}:3: not a trainvitals report: step:" in out
    torn = tmp_path / "torn.jsonl"
    torn.write_text(lines[0] + "\n" + lines[1][:40] + "\n")
    code, out = _check(str(torn))
    assert code == 2 and f"{torn}:2: not valid JSON" in out
    code, out = _check(str(tmp_path / "missing.jsonl"))
    assert code == 2 and "missing.jsonl: cannot read it" in out
    code, out = _check("--rules", str(tmp_path / "norules.yaml"), str(recorded["i2"]))
    assert code == 2 and "--rules" in out


def test_check_with_other_rules(recorded: dict[str, Path], tmp_path: Path):
    rules = tmp_path / "mine.yaml"
    rules.write_text("- {alert: MassAboveTwo, metric: loss_weight_mass, above: 2, severity: warning, summary: s}\n")
    code, out = _check("--rules", str(rules), str(recorded["i2"]))
    assert code == 1 and "MassAboveTwo" in out and "LossNotAccumNormalized" not in out  # a warning fired


# -- the pre-flight check ---------------------------------------------------------------------


def _preflight(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINVITALS_")}
    return subprocess.run(
        [sys.executable, "-m", "trainvitals.monitor.cli", "check", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_preflight_names_the_missing_accumulation_division_within_30_steps(tmp_path: Path):
    done = _preflight(tmp_path, "--steps", "30", "--run", "pre", "--", sys.executable, str(SCRIPT))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "PAGE LossNotAccumNormalized {objective=main}: fired at step 22" in done.stdout
    assert "what was watched in run pre:" in done.stdout
    # What was watched, from the reports' coverage: zero-code loss accounting engaged.
    assert "  loss: active in 29 of 30 reports (else no_input)" in done.stdout
    assert "  softmax: not_requested: no observe_logits() or observe_distillation() call" in done.stdout
    assert "stopping the job after 30 optimizer steps" in done.stderr
    assert "trained 200 steps" not in done.stdout  # stopped, not run to its end
    reports = [json.loads(line) for line in (tmp_path / "trainvitals-check-pre.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in reports) == 30

    done = _preflight(
        tmp_path, "--steps", "30", "--run", "pre-fixed", "--json", "--", sys.executable, str(SCRIPT), "--fixed"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (run,) = json.loads(done.stdout)["runs"]
    assert run["incidents"] == [] and run["signals"]["loss"]["active"] == 29


@pytest.mark.slow
def test_preflight_of_a_job_that_steps_no_optimizer_says_nothing_was_watched(tmp_path: Path):
    done = _preflight(tmp_path, "--", sys.executable, "-c", "print('no training here')")
    assert done.returncode == 3
    assert "nothing was watched" in done.stderr
