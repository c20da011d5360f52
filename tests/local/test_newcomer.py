"""What a newcomer meets first: ``attach(model, opt)`` alone, ``track_loss`` on a
text-only job, ``trainvitals check`` as the README documents it. No false all-clear:
a verdict says what it checked, and what it did not and why.

Real jobs: a script run as its own process (``tests/local/scripts/attach_accum.py``,
nothing but ``attach(model, opt)``), the CLI as a user types it, tiny models trained
here with the truth taken by autograd.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch import nn

from trainvitals.hooks import attach
from trainvitals.monitor.cli import main

SCRIPT = Path(__file__).parent / "scripts" / "attach_accum.py"


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TRAINVITALS_")}


def _script(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300
    )


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainvitals.monitor.cli", *args],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "trainvitals"]


def _lm() -> nn.Module:
    return nn.Sequential(nn.Embedding(64, 16), nn.RMSNorm(16), nn.Linear(16, 64))


# -- attach() alone: loss accounting on by default ------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fixed", [False, True], ids=["missing-division", "fixed-twin"])
def test_attach_alone_flags_the_missing_division_in_the_jobs_own_output(fixed: bool, tmp_path: Path):
    done = _script(tmp_path, *(["--fixed"] if fixed else []))
    assert done.returncode == 0, done.stderr
    err = done.stderr
    (verdict,) = [line for line in err.splitlines() if line.startswith("trainvitals verdict")]
    if fixed:
        assert "trainvitals alert" not in err
        assert verdict.startswith("trainvitals verdict for run newcomer-fixed: no incident in 6 reports (steps 1-40); ")
        assert (
            "checked: optimizer, params, adam, loss; not checked: probe (not requested), softmax (not requested)"
        ) in verdict
        return
    assert "trainvitals alert LossNotAccumNormalized firing at step 30 (value 4)" in err
    assert "1 incident(s)" in verdict and "checked: optimizer, params, adam, loss" in verdict
    assert "WARNING LossNotAccumNormalized {objective=main}" in err


@pytest.mark.slow
def test_check_exits_non_zero_on_the_missing_division_under_adamw(tmp_path: Path):
    done = _cli(tmp_path, "check", "--steps", "30", "--run", "nc", "--", sys.executable, str(SCRIPT))
    assert done.returncode == 1, done.stdout + done.stderr  # --fail-on warning, the default
    assert "WARNING LossNotAccumNormalized {objective=main}: fired at step 21" in done.stdout
    done = _cli(tmp_path, "check", "--fail-on", "page", "--steps", "30", "--", sys.executable, str(SCRIPT))
    assert done.returncode == 0, done.stdout + done.stderr  # a warning only, under AdamW
    done = _cli(tmp_path, "check", "--steps", "30", "--", sys.executable, str(SCRIPT), "--fixed")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no incident in 31 reports (steps 1-30); checked: optimizer, params, adam, loss;" in done.stdout


@pytest.mark.slow
def test_check_steps_and_every_apply_to_a_job_that_attaches_its_own_monitor(tmp_path: Path):
    done = _cli(tmp_path, "check", "--steps", "12", "--run", "own", "--", sys.executable, str(SCRIPT), "--every", "5")
    assert "trained 40 steps" not in done.stdout  # stopped at --steps
    assert "stopping the job after 12 optimizer steps" in done.stderr
    assert "reporting every 1 step(s) as the check asks, not every=5" in done.stderr
    reports = [json.loads(line) for line in (tmp_path / "trainvitals-check-own.jsonl").read_text().splitlines()]
    steps = sorted({r["step"] for r in reports})
    assert steps == list(range(1, 13))  # every step, as the check asked, not every 5th


def test_a_model_without_lm_head_says_loss_accounting_is_off_and_why(caplog: pytest.LogCaptureFixture):
    model = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 7))  # a token classifier, no LM head
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with caplog.at_level(logging.INFO, logger="trainvitals"):
        mon = attach(model, opt, run="cls", sink="null", every=1)
        for _ in range(3):
            ids = torch.randint(0, 64, (4, 5))
            F.cross_entropy(model(ids).flatten(0, 1), torch.randint(0, 7, (20,))).backward()
            opt.step()
            opt.zero_grad()
        mon.close()
    messages = _messages(caplog)
    start = next(m for m in messages if "watching" in m)
    assert "blind: loss (no_lm_head: no LM head found" in start
    (verdict,) = [m for m in messages if m.startswith("trainvitals verdict")]
    assert "no incident in 4 reports" in verdict
    assert "not checked: loss (no LM head found), probe (not requested), softmax (not requested)" in verdict


def test_loss_from_logits_false_turns_it_off_and_says_not_requested(caplog: pytest.LogCaptureFixture):
    model = _lm()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with caplog.at_level(logging.INFO, logger="trainvitals"):
        with attach(model, opt, run="off", sink="null", every=1, loss_from_logits=False) as mon:
            assert not mon.reads_logits
            ids = torch.randint(0, 64, (4, 6))
            F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
            opt.step()
    (verdict,) = [m for m in _messages(caplog) if m.startswith("trainvitals verdict")]
    assert "not checked: loss (not requested)" in verdict


# -- track_loss on a text-only job -----------------------------------------------------------------


def _train_tracked(mon, model, opt, *, steps: int, accum: int, declared: bool) -> list[float]:
    """Train with track_loss and no modality; return each step's true weight mass
    (autograd: d loss / d per-token loss, summed over the step's micro-batches)."""
    masses = []
    for _ in range(steps):
        mass = 0.0
        for _micro in range(accum):
            ids = torch.randint(0, 64, (4, 6))
            per_token = F.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten(), reduction="none")
            per_token = per_token.view(4, 6)
            per_token.retain_grad()
            mon.track_loss(per_token, **({"modality": "text"} if declared else {}))
            (per_token.mean() / accum * 1.5).backward()  # 1.5: a mass the monitor must read, not assume
            mass += float(per_token.grad.sum())
        opt.step()
        opt.zero_grad()
        masses.append(mass)
    return masses


@pytest.mark.parametrize("declared", [False, True], ids=["no-modalities", "one-modality"])
def test_track_loss_on_a_text_only_job_needs_no_modality(declared: bool, caplog: pytest.LogCaptureFixture):
    torch.manual_seed(0)
    model = _lm()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mods = {"modalities": ("text",)} if declared else {}
    with caplog.at_level(logging.INFO, logger="trainvitals"):
        mon = attach(model, opt, run="text", sink="null", every=1, **mods)
        masses = _train_tracked(mon, model, opt, steps=3, accum=3, declared=False)
        latest = {(s["name"], tuple(sorted(s["labels"].items()))): s["value"] for s in mon.latest()}
        mon.close()
    assert latest[("microbatches", ())] == 3  # read once each: the head's own reading gave way
    assert latest[("loss_weight_mass", (("objective", "main"),))] == pytest.approx(masses[-1], rel=1e-5)
    assert masses[-1] == pytest.approx(1.5, rel=1e-5)
    warnings = [r.getMessage() for r in caplog.records if r.name == "trainvitals" and r.levelno >= logging.WARNING]
    assert not [w for w in warnings if "modality" in w or "tag" in w], warnings
    if declared:  # one modality: its figures are the whole job's
        assert latest[("modality_token_share_ratio", (("modality", "text"),))] == pytest.approx(1.0)


def test_track_loss_without_modality_warns_once_when_several_are_declared(caplog: pytest.LogCaptureFixture):
    model = _lm()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with caplog.at_level(logging.WARNING, logger="trainvitals"):
        mon = attach(model, opt, run="two", sink="null", every=1, modalities=("text", "image"))
        _train_tracked(mon, model, opt, steps=2, accum=2, declared=False)
        mon.close()
    untagged = [m for m in _messages(caplog) if "came without modality=" in m]
    assert len(untagged) == 1 and "text/image" in untagged[0]


def test_track_loss_modality_codes_without_names_still_say_what_to_pass():
    model = _lm()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with attach(model, opt, run="codes", sink="null") as mon:
        per_token = F.cross_entropy(
            model(torch.randint(0, 64, (2, 3))).flatten(0, 1), torch.zeros(6, dtype=torch.long), reduction="none"
        ).view(2, 3)
        with pytest.raises(ValueError, match="leave modality out"):
            mon.track_loss(per_token, modality=torch.zeros(2, dtype=torch.long))


# -- check as documented -------------------------------------------------------------------------


def _record(tmp_path: Path, run: str, *, steps: int = 25, mass: float = 1.0) -> Path:
    """A real job's report file: mass 4 (the missing division) or 1."""
    torch.manual_seed(0)
    model = _lm()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    path = tmp_path / f"{run}.jsonl"
    with attach(model, opt, run=run, sink=f"file:{path}", every=1, rules="off") as mon:
        for _ in range(steps):
            for _micro in range(4):
                ids = torch.randint(0, 64, (4, 6))
                loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
                (loss * mass / 4).backward()
            opt.step()
            opt.zero_grad()
        assert mon.step == steps
    return path


def _check(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["check", *args])
    return result.exit_code, result.output


def test_check_refuses_a_file_that_is_no_report_file_and_runs_nothing(tmp_path: Path):
    notes = tmp_path / "plain.txt"
    notes.write_text("echo ran > ran.txt\n")
    notes.chmod(0o644)
    code, out = _check(str(notes))
    assert code == 2 and "plain.txt: not a trainvitals report file" in out
    assert not (tmp_path / "ran.txt").exists()
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    code, out = _check(str(script))
    assert code == 2 and "trainvitals check -- python" in out


def test_check_reads_a_report_file_of_any_name(tmp_path: Path):
    path = _record(tmp_path, "named", steps=3)
    other = path.rename(tmp_path / "reports.log")
    code, out = _check(str(other))
    assert code == 0 and out.startswith("named: no incident in 4 reports (steps 1-3); checked: optimizer")


def test_check_renders_the_templates_of_its_own_rules(tmp_path: Path):
    path = _record(tmp_path, "tpl", steps=3, mass=4.0)
    rules = tmp_path / "mine.yaml"
    rules.write_text(
        "- alert: MassHigh\n  metric: loss_weight_mass\n  above: 2\n  severity: page\n"
        "  summary: 'Run {run}: mass {value:.1f}.'\n"
    )
    code, out = _check("--rules", str(rules), str(path))
    assert code == 1
    assert "Run tpl: mass 4.0." in out and "{value" not in out and "{run}" not in out


def test_check_keeps_runs_of_one_name_from_two_files_apart_and_says_so(tmp_path: Path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    bad = _record(tmp_path / "a", "same", mass=4.0)
    good = _record(tmp_path / "b", "same", mass=1.0)
    result = CliRunner().invoke(main, ["check", "--json", str(bad), str(good)])
    assert "run 'same' is in 2 files" in result.stderr
    runs = json.loads(result.stdout)["runs"]
    assert [(r["run"], r["file"], len(r["incidents"])) for r in runs] == [("same", str(bad), 1), ("same", str(good), 0)]
    _, out = _check(str(bad), str(good))
    assert f"same [{bad}]" in out and f"same [{good}]: no incident" in out


def test_check_fail_on(tmp_path: Path):
    rules = tmp_path / "warn.yaml"
    rules.write_text("- {alert: MassHigh, metric: loss_weight_mass, above: 2, severity: warning, summary: s}\n")
    path = _record(tmp_path, "warn", steps=3, mass=4.0)
    assert _check("--rules", str(rules), str(path))[0] == 1  # default: a warning fails the check
    assert _check("--fail-on", "warning", "--rules", str(rules), str(path))[0] == 1
    assert _check("--fail-on", "page", "--rules", str(rules), str(path))[0] == 0
    code, out = _check("--fail-on", "info", str(path))
    assert code == 2 and "info" in out


# -- a collector: alert lines in the job, reports kept when it cannot be reached -----------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_collector_leaves_the_reports_in_the_local_file_and_rules_run_in_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = _lm()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    url = f"http://127.0.0.1:{_closed_port()}"
    with caplog.at_level(logging.INFO, logger="trainvitals"):
        with attach(model, opt, run="down", collector=url, every=1, flush_timeout=0.5):
            for _ in range(25):
                for _micro in range(4):
                    ids = torch.randint(0, 64, (4, 6))
                    F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()  # no / 4
                opt.step()
                opt.zero_grad()
    messages = _messages(caplog)
    assert any(m.startswith("trainvitals alert LossNotAccumNormalized firing at step 21") for m in messages)
    kept = tmp_path / "trainvitals-down.jsonl"
    reports = [json.loads(line) for line in kept.read_text().splitlines()]
    assert sorted({r["step"] for r in reports}) == list(range(1, 26))  # none lost
    assert any("never took are in trainvitals-down.jsonl" in m and "trainvitals replay" in m for m in messages)
    # the kept file is a report file: check judges it as the job did
    code, out = _check(str(kept))
    assert code == 1 and "LossNotAccumNormalized" in out


@pytest.mark.slow
def test_with_a_collector_the_job_still_prints_each_alert_line(caplog: pytest.LogCaptureFixture):
    from tests.e2e._jobs import DilutionJob
    from tests.support import running_collector

    job = DilutionJob()
    with running_collector() as c, caplog.at_level(logging.INFO, logger="trainvitals"):
        mon = attach(job.model, job.opt, run="seen", collector=c.url, modalities=job.modalities, every=1)
        job.train(mon, 25)
        assert mon.flush(60)
        collector_says = c.wait_for("GradientDilution", "seen")
        mon.close()
    lines = [m for m in _messages(caplog) if m.startswith("trainvitals alert GradientDilution firing")]
    assert len(lines) == 1 and lines[0].startswith("trainvitals alert GradientDilution firing at step 21 (value 16.96)")
    assert collector_says["fired_value"] == pytest.approx(16.96, abs=0.01)  # the collector judged the same
