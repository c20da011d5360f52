"""The Hugging Face Trainer callback on a tiny Llama built from a config (no download),
against the true per-token weights recorded independently (``_hf_job.Truth``): the
current transformers (normalized over the accumulated batch: nothing fires), a
hand-written compute_loss that forgets the accumulation division
(LossNotAccumNormalized), a release from before the mean-of-means fix, transformers
#34191 (MeanOfMeansLoss), checkpoints, and two gloo ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integrations._alerts import LOSS_RULES, figures, firing, read_reports
from tests.support import free_port

HERE = Path(__file__).resolve().parent
JOB = HERE / "_hf_job.py"
ROOT = HERE.parents[1]

OLD_TRANSFORMERS_ENV = "TRAINVITALS_OLD_TRANSFORMERS"
OLD_TRANSFORMERS = os.environ.get(OLD_TRANSFORMERS_ENV, "/tmp/tv-old-transformers")
OLD_INSTALL = (
    f'pip install --target {OLD_TRANSFORMERS} "tokenizers==0.20.3" "huggingface-hub==0.26.5" && '
    f'pip install --target {OLD_TRANSFORMERS} --no-deps "transformers==4.45.2" "accelerate==1.0.1"'
)
OLD_PACKAGES = ("transformers==4.45.2", "accelerate==1.0.1")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning")


def run_job(tmp_path: Path, *options: str, env: dict | None = None, ranks: int = 1, timeout: float = 300) -> dict:
    """``_hf_job.train`` in fresh processes (one per rank): the Trainer changes the working
    folder and global state; a subprocess keeps the test process clean."""
    out = tmp_path / "result.json"
    base = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    port = free_port()
    procs = []
    for rank in range(ranks):
        rank_env = dict(base)
        if ranks > 1:
            rank_env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(ranks),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(JOB), str(out), f"out_dir={tmp_path / 'run'}", f"rank={rank}", *options],
                env=rank_env,
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the Trainer job did not finish within {timeout} s")
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-6000:]
    result = json.loads(out.read_text())
    result["log"] = logs[0]
    return result


def check_against_truth(result: dict, every: int) -> list[dict]:
    """Every reported step's weight mass, micro-batch count, spread and modality shares
    equal the true weights'; returns the reports."""
    reports = read_reports(result["reports"])
    mass = figures(reports, "loss_weight_mass", objective="main")
    micro = figures(reports, "microbatches")
    spread = figures(reports, "token_weight_spread_ratio", objective="main")
    share = figures(reports, "modality_grad_share_ratio", modality="image")
    truth = {t["step"]: t for t in result["truth"]}
    reported = [s for s in truth if s == 1 or s % every == 0]
    assert reported and sorted(mass) == reported, (sorted(mass), reported)
    for s in reported:
        t = truth[s]
        assert mass[s] == pytest.approx(t["mass"], rel=1e-5), s
        assert micro[s] == t["microbatches"], s
        assert share[s] == pytest.approx(t["grad_share"][1], rel=1e-5), s
        if t["spread"] is None:
            assert s not in spread
        else:
            assert spread[s] == pytest.approx(t["spread"], rel=1e-5), s
    return reports


def test_current_trainer_weights_equal_the_truth_and_nothing_fires(tmp_path):
    result = run_job(tmp_path, "steps=60", "every=5", "accum=4")
    reports = check_against_truth(result, every=5)
    # One line at start (what is watched), one at close (what was reported and delivered).
    (start,) = [line for line in result["log"].splitlines() if "(from the first optimizer step)" in line]
    assert "watching optimizer, params, adam, loss" in start
    (close,) = [line for line in result["log"].splitlines() if "closed after 60 optimizer step(s)" in line]
    assert "reported: optimizer" in close and "loss (" in close and " 0 not delivered" in close, close
    assert all(t["mass"] == pytest.approx(1.0, rel=1e-5) for t in result["truth"])  # normalized over the step
    assert all(t["spread"] == pytest.approx(1.0, rel=1e-5) for t in result["truth"])
    assert not firing(reports) & LOSS_RULES


def test_a_compute_loss_that_forgets_the_division_fires_loss_not_accum_normalized(tmp_path):
    result = run_job(tmp_path, "steps=30", "every=5", "accum=4", "trainer=forgetful")
    reports = check_against_truth(result, every=5)
    assert all(t["mass"] == pytest.approx(4.0, rel=1e-5) for t in result["truth"])
    assert figures(reports, "loss_accumulation_exponent", objective="main")[30] == pytest.approx(1.0, abs=1e-5)
    assert "LossNotAccumNormalized" in firing(reports)


def _install_old_transformers() -> None:
    """The release from before the fix, in a folder of its own (never on this venv's path:
    it would shadow the current one). .ci/run installs it first; a fresh clone's run of
    the suite installs it here, or, without a package index, skips with the command."""
    if (Path(OLD_TRANSFORMERS) / "transformers").is_dir():
        return
    for packages in (["tokenizers==0.20.3", "huggingface-hub==0.26.5"], ["--no-deps", *OLD_PACKAGES]):
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--target", OLD_TRANSFORMERS, *packages]
        done = subprocess.run(pip, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            pytest.skip(
                f"transformers 4.45.2 is not in {OLD_TRANSFORMERS} and pip could not install it "
                f"({done.stderr.strip().splitlines()[-1:]}); install it with: {OLD_INSTALL} "
                f"(or set ${OLD_TRANSFORMERS_ENV} to where it is)"
            )


def test_a_release_before_the_mean_of_means_fix_fires_mean_of_means_loss(tmp_path):
    _install_old_transformers()
    env = {"PYTHONPATH": os.pathsep.join([OLD_TRANSFORMERS, str(ROOT)]), "TV_HIDE_DATASETS": "1"}
    result = run_job(tmp_path, "steps=60", "every=5", "accum=4", env=env)
    assert result["version"] == "4.45.2"
    reports = check_against_truth(result, every=5)
    # Each micro-batch's mean divided by 4: a label token of the 6-token sample (5 after the
    # shift) weighs 29/5 = 5.8x one of the 30-token sample.
    assert all(t["spread"] == pytest.approx(29 / 5, rel=1e-5) for t in result["truth"])
    assert firing(reports) & LOSS_RULES == {"MeanOfMeansLoss"}


def test_the_monitor_state_travels_with_the_trainer_checkpoints(tmp_path):
    first = run_job(tmp_path, "steps=4", "save_steps=2")
    assert first["state_files"] == ["checkpoint-2/trainvitals-rank0.pt", "checkpoint-4/trainvitals-rank0.pt"]
    resumed = run_job(tmp_path, "steps=6", "save_steps=2", "resume=1")
    assert resumed["step"] == 6  # resumed at the checkpoint's step 4, not from 0
    steps = [r["step"] for r in read_reports(resumed["reports"]) if r.get("samples")]
    assert steps[-1] == 6 and 5 not in steps[: steps.index(4) + 1]


@pytest.mark.slow
def test_two_gloo_ranks(tmp_path):
    result = run_job(tmp_path, "steps=4", "every=1", "accum=2", ranks=2)
    reports = read_reports(result["reports"])
    mass = figures(reports, "loss_weight_mass", objective="main")
    micro = figures(reports, "microbatches")
    # Tokens averaged across ranks: each rank's weights sum to world x its share, DDP averages.
    assert mass == {s: pytest.approx(1.0, rel=1e-5) for s in (1, 2, 3, 4)}
    assert micro == {s: 2 for s in (1, 2, 3, 4)}
    assert not firing(reports) & LOSS_RULES
