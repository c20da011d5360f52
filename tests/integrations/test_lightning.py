"""The Lightning callback with accumulate_grad_batches=2 on a tiny LightningModule,
against the true per-token weights recorded independently (``_lightning_job.Truth``).
Lightning runs a step's last micro-batch inside ``optimizer.step(closure)``, after the
optimizer's pre-step hooks; the step must still be accounted whole. Lightning
divides each micro-batch's token mean by the accumulation count: a mean of means,
which fires MeanOfMeansLoss when the micro-batches' token counts differ."""

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
JOB = HERE / "_lightning_job.py"


def run_job(
    tmp_path: Path, *options: str, ranks: int = 1, timeout: float = 300, env: dict[str, str] | None = None
) -> dict:
    """``_lightning_job.train`` in fresh processes, one per rank (Lightning's DDP takes
    its ranks from LOCAL_RANK/WORLD_SIZE when they are set)."""
    out = tmp_path / "result.json"
    port = free_port()
    procs = []
    for rank in range(ranks):
        rank_env = {**os.environ, **(env or {})}
        if ranks > 1:
            rank_env.update(
                LOCAL_RANK=str(rank),
                NODE_RANK="0",
                WORLD_SIZE=str(ranks),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(JOB),
                    str(out),
                    f"out_dir={tmp_path / 'run'}",
                    f"rank={rank}",
                    f"devices={ranks}",
                    *options,
                ],
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
        pytest.fail(f"the Lightning job did not finish within {timeout} s")
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-6000:]
    result = json.loads(out.read_text())
    result["log"] = logs[0]
    return result


def test_accumulated_steps_are_accounted_whole_and_mean_of_means_fires(tmp_path):
    result = run_job(tmp_path, "steps=60", "every=5", "accum=2")
    reports = read_reports(result["reports"])
    mass = figures(reports, "loss_weight_mass", objective="main")
    micro = figures(reports, "microbatches")
    spread = figures(reports, "token_weight_spread_ratio", objective="main")
    truth = {t["step"]: t for t in result["truth"]}
    reported = [s for s in truth if s == 1 or s % 5 == 0]
    assert sorted(mass) == reported
    for s in reported:
        assert micro[s] == truth[s]["microbatches"] == 2, s  # the closure's micro-batch included
        assert mass[s] == pytest.approx(truth[s]["mass"], rel=1e-5), s
        assert spread[s] == pytest.approx(truth[s]["spread"], rel=1e-5), s
    # Token means over 6 and 30 (or 12 and 24) label tokens, each halved: 30/6 = 5 or 24/12 = 2.
    assert {round(t["spread"], 4) for t in result["truth"]} == {5.0, 2.0}
    assert firing(reports) & LOSS_RULES == {"MeanOfMeansLoss"}
    # One line at start (what is watched), one at close (what was reported and delivered).
    (start,) = [line for line in result["log"].splitlines() if "(from the first optimizer step)" in line]
    assert "watching optimizer, params, adam, loss" in start
    (close,) = [line for line in result["log"].splitlines() if "closed after 60 optimizer step(s)" in line]
    assert "reported: optimizer" in close and " 0 not delivered" in close, close


@pytest.mark.parametrize("lengths", ["", "16,16"], ids=["mean-of-means", "healthy-equal-lengths"])
def test_with_only_pytorch_lightning_installed(tmp_path, lengths):
    """``lightning`` refused at import (as where only ``pytorch_lightning`` is installed):
    the callback runs on ``pytorch_lightning``, its figures equal the truth, the mean of
    means fires and its healthy twin (equal token counts) fires nothing."""
    options = ["steps=60", "every=5", "accum=2"] + ([f"lengths={lengths}"] if lengths else [])
    result = run_job(tmp_path, *options, env={"TV_ONLY_PYTORCH_LIGHTNING": "1"})
    assert result["package"] == "pytorch_lightning"
    assert result["callback_base"].startswith("pytorch_lightning.")
    assert not result["lightning_imported"]
    reports = read_reports(result["reports"])
    mass = figures(reports, "loss_weight_mass", objective="main")
    spread = figures(reports, "token_weight_spread_ratio", objective="main")
    truth = {t["step"]: t for t in result["truth"]}
    reported = [s for s in truth if s == 1 or s % 5 == 0]
    assert sorted(mass) == reported
    for s in reported:
        assert mass[s] == pytest.approx(truth[s]["mass"], rel=1e-5), s
        assert spread[s] == pytest.approx(truth[s]["spread"], rel=1e-5), s
    assert firing(reports) & LOSS_RULES == (set() if lengths else {"MeanOfMeansLoss"})


def test_the_monitor_state_travels_with_lightning_checkpoints(tmp_path):
    ckpt = tmp_path / "last.ckpt"
    first = run_job(tmp_path, "steps=4", f"ckpt={ckpt}")
    assert first["step"] == 4
    resumed = run_job(tmp_path, "steps=6", f"resume={ckpt}")
    assert resumed["step"] == 6  # continued from the checkpoint's 4
    assert [t["step"] for t in resumed["truth"]] == [5, 6]


@pytest.mark.slow
def test_two_gloo_ranks_with_ddp(tmp_path):
    result = run_job(tmp_path, "steps=4", "every=1", "accum=2", ranks=2)
    reports = read_reports(result["reports"])
    mass = figures(reports, "loss_weight_mass", objective="main")
    micro = figures(reports, "microbatches")
    assert micro == {s: 2 for s in (1, 2, 3, 4)}
    # Each rank's weights sum to 1 (mean of its micro-batch means); DDP averages the ranks.
    assert mass == {s: pytest.approx(1.0, rel=1e-5) for s in (1, 2, 3, 4)}
