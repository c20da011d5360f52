"""Loss accounting under DTensor tensor parallelism, two gloo ranks on the CPU
(``_tp_loss_job.py``): the tiny decoder of ``tests/hooks/_tp_models.py`` split by
``parallelize_module`` on a 1-D mesh of 2, its head plain (replicated), vocab-parallel
(``ColwiseParallel(use_local_output=False)``: ``Shard(-1)`` logits, the loss under
``loss_parallel()``, per-token losses a replicated DTensor) or column-wise gathered back
to ``Replicate`` logits.

Both ranks see the same tokens (the job's data-parallel size is 1). The loss figures are
checked against the per-token weights autograd gives at the job's per-token losses (a
tensor hook in the job, independent of trainvitals), through ``attach`` + ``track_loss``,
``attach(loss_from_logits=True)`` and ``trainvitals run``; every optimizer/params/adam
figure against the full tensors (``tests/hooks/_tp_models.truth``)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.integrations._alerts import LOSS_RULES, figures, firing, read_reports
from tests.run_configure._helpers import job_env, trainvitals
from tests.support import run_ranks

HERE = Path(__file__).resolve().parent
JOB = HERE / "_tp_loss_job.py"
TIMEOUT_S = 300

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore"),
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable"),
]


def _run(tmp_path: Path, *options: str) -> tuple[dict, list[dict]]:
    out = tmp_path / "result.json"
    got = run_ranks(JOB, out, *options, world=2, timeout=TIMEOUT_S)
    return got, read_reports(out.with_suffix(".jsonl"))


def _loss_truth(got: dict) -> dict[int, dict[str, float]]:
    """Per step, from autograd's weights at the per-token losses (one rank's: both ranks
    hold the same tokens): the weight mass, the image share of the gradient, the dilution."""
    out = {}
    for k, t in enumerate(got["truth"]):
        share = t["image"] / t["mass"]
        out[k + 1] = {"mass": t["mass"], "share": share, "dilution": (t["images"] / t["samples"]) / share}
    return out


def _check_loss(got: dict, reports: list[dict], steps: int) -> dict[int, dict[str, float]]:
    assert got["coverage"]["loss"]["active"], got["coverage"]["loss"]
    assert got["data_parallel_size"] == 1  # tensor parallelism alone: one copy of the data
    truth = _loss_truth(got)
    mass = figures(reports, "loss_weight_mass", objective="main")
    share = figures(reports, "modality_grad_share_ratio", modality="image")
    dilution = figures(reports, "modality_dilution_ratio", modality="image")
    assert sorted(mass) == sorted(share) == sorted(dilution) == list(range(1, steps + 1))
    for s in range(1, steps + 1):
        assert mass[s] == pytest.approx(truth[s]["mass"], rel=1e-5) == pytest.approx(1.0), s
        assert share[s] == pytest.approx(truth[s]["share"], rel=1e-5), s
        assert dilution[s] == pytest.approx(truth[s]["dilution"], rel=1e-5), s
    kinds = {e["kind"] for r in reports for e in r.get("events", [])}
    assert "loss_not_cross_entropy" not in kinds
    return truth


def _check_figures(got: dict) -> None:
    assert all(got["coverage"][s]["active"] for s in ("optimizer", "params", "adam"))
    assert got["reports"] and len(got["reports"]) == len(got["truths"])
    kinds = {key.split("|")[0] for key in got["truths"][0]}
    assert {"grad_norm", "group_grad_norm", "param_norm", "update_ratio", "param_grad_relative_rms"} <= kinds
    assert {"param_min", "param_drift_log2", "adam_exp_avg_norm", "adam_normalized_update_rms"} <= kinds
    for k, (report, truth) in enumerate(zip(got["reports"], got["truths"], strict=True)):
        for key, want in truth.items():
            assert key in report, (k, key)
            assert report[key] == pytest.approx(want, rel=1e-4, abs=1e-12), (k, key)


LAYOUTS = [
    pytest.param("plain", "track", id="plain-head-track_loss"),
    pytest.param("plain", "logits", id="plain-head-zero-code"),
    pytest.param("vocab", "track", id="vocab-parallel-head-track_loss"),
    pytest.param("vocab", "logits", id="vocab-parallel-head-zero-code"),
]


@pytest.mark.parametrize(("head", "how"), LAYOUTS)
def test_per_token_loss_dilutes_the_image_samples_and_pages(tmp_path, head, how):
    """I1: 4 of 25 samples (16%) are image samples with 2 label tokens against the text
    samples' 40, the loss divided by the step's label tokens: the image share of the
    gradient is 8 / 848 and GradientDilution fires at 16.96, every figure exact."""
    got, reports = _run(tmp_path, f"head={head}", f"how={how}", "norm=token", "steps=24", "figures=1")
    truth = _check_loss(got, reports, 24)
    assert truth[24]["dilution"] == pytest.approx(0.16 / (8 / 848)) == pytest.approx(16.96)
    _check_figures(got)
    assert firing(reports) & LOSS_RULES == {"GradientDilution"}


@pytest.mark.parametrize(("head", "how"), LAYOUTS)
def test_per_sample_loss_twin_is_silent(tmp_path, head, how):
    """The twin: each sample averaged over its own label tokens, then over the samples:
    every sample weighs the same, the image share of the gradient is their 16%."""
    got, reports = _run(tmp_path, f"head={head}", f"how={how}", "norm=sample", "steps=24")
    truth = _check_loss(got, reports, 24)
    assert truth[24]["share"] == pytest.approx(0.16)
    assert not firing(reports) & LOSS_RULES


def test_replicated_dtensor_logits_read_whole(tmp_path):
    """A column-wise head gathered back to ``Replicate`` DTensor logits (and losses):
    every rank holds them whole; both paths read them."""
    for how in ("track", "logits"):
        got, reports = _run(tmp_path, "head=replicate", f"how={how}", "norm=token", "steps=3")
        _check_loss(got, reports, 3)


@pytest.mark.parametrize("head", ["plain", "vocab"])
def test_adam_walks_the_zero_gradient_gain_and_param_drift_pages(tmp_path, head):
    """I4: a ``[1]`` replicated gain in front of the final RMSNorm (true gradient zero)
    fed biased noise below Adam's eps, without weight decay: ParamDrift fires on it."""
    got, reports = _run(tmp_path, f"head={head}", "how=track", "norm=sample", "drift=1", "steps=56")
    assert got["gain"] > 0.5  # walked from 0.25 by Adam's eps-level steps
    assert "ParamDrift" in firing(reports)
    drift = figures(reports, "param_drift_log2", param="gain")
    assert drift[56] == pytest.approx(math.log2(got["gain"] / 0.25), rel=1e-4)


@pytest.mark.parametrize("head", ["plain", "vocab"])
def test_gain_with_its_gradient_zeroed_twin_is_silent(tmp_path, head):
    got, reports = _run(tmp_path, f"head={head}", "how=track", "norm=sample", "drift=1", "fixed=1", "steps=56")
    assert got["gain"] == pytest.approx(0.25)
    assert "ParamDrift" not in firing(reports)
    assert not firing(reports) & LOSS_RULES


def test_fsdp2_data_parallel_size_is_its_mesh(tmp_path):
    """FSDP2 (``fully_shard``) on the same mesh of two: its ranks are data-parallel (the
    data-parallel size is the mesh's 2, not tensor parallelism's 1), so the loss averaged
    over them has a weight mass of 1 summing both ranks' tokens."""
    got, reports = _run(tmp_path, "layout=fsdp", "how=track", "norm=token", "steps=3")
    assert got["data_parallel_size"] == 2
    mass = figures(reports, "loss_weight_mass", objective="main")
    share = figures(reports, "modality_grad_share_ratio", modality="image")
    truth = _loss_truth(got)
    for s in (1, 2, 3):
        assert mass[s] == pytest.approx(truth[s]["mass"], rel=1e-5) == pytest.approx(1.0), s
        assert share[s] == pytest.approx(truth[s]["share"], rel=1e-5), s


def test_token_sharded_losses_are_withheld_naming_the_layout(tmp_path):
    """Per-token losses sharded over the ranks (``Shard(0)``: each rank holds other
    samples): the mask and tags passed do not say which, so nothing is read and the loss
    coverage names the layout; the other signals stand."""
    got, reports = _run(tmp_path, "head=vocab", "how=track", "norm=token", "steps=3", "tokens=shard")
    entry = got["coverage"]["loss"]
    assert (entry["active"], entry["reason"]) == (False, "sharded"), entry
    assert "Shard(dim=0)" in entry["detail"]
    assert not figures(reports, "loss_weight_mass", objective="main")
    assert got["coverage"]["optimizer"]["active"]


def test_trainvitals_run_reads_the_vocab_parallel_head(tmp_path):
    """Zero-code: a job that knows nothing of trainvitals, under ``trainvitals run`` and
    ``torchrun``, its head vocab-parallel and its loss under ``loss_parallel()``."""
    out = tmp_path / "result.json"
    reports_file = tmp_path / "reports.jsonl"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    job = [*launcher, str(JOB), str(out), "how=plain", "head=vocab", "norm=token", "steps=4"]
    run = ["run", "--run", "tploss", "--collector", f"file:{reports_file}", "--every", "1", "--", *job]
    proc = trainvitals(*run, env=job_env(), cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "loss accounting from the logits of 'head'" in proc.stderr
    truth = _loss_truth(json.loads(out.read_text()))
    reports = read_reports(reports_file)
    mass = figures(reports, "loss_weight_mass", objective="main")
    assert sorted(mass) == [2, 3, 4]  # attached at the first step's pre-step hook
    for s in (2, 3, 4):
        assert mass[s] == pytest.approx(truth[s]["mass"], rel=1e-5) == pytest.approx(1.0), s
    assert sorted(figures(reports, "grad_norm")) == [1, 2, 3, 4]
    kinds = {e["kind"] for r in reports for e in r.get("events", [])}
    assert "loss_not_cross_entropy" not in kinds


@pytest.mark.parametrize(
    ("norm", "fixed", "fires"),
    [
        pytest.param("token", "0", {"GradientDilution", "ParamDrift"}, id="I1-I4"),
        pytest.param("sample", "1", set(), id="twins"),
    ],
)
def test_fsdp2_pages_dilution_and_drift_and_its_twins_are_silent(tmp_path, norm, fixed, fires):
    """FSDP2 alone (``fully_shard`` on the mesh of two, the 1-element gain an empty shard
    on rank 1): I1's dilution (16.96 from autograd's weights) and I4's drifting gain page,
    every optimizer/params/adam figure exact; the per-sample loss and the zeroed gain
    (the twins) page nothing."""
    options = [f"norm={norm}", "drift=1", f"fixed={fixed}", "steps=56", "figures=1", "every=4"]
    got, reports = _run(tmp_path, "layout=fsdp", "how=track", *options)
    assert got["data_parallel_size"] == 2
    _check_figures(got)
    truth = _loss_truth(got)
    mass = figures(reports, "loss_weight_mass", objective="main")
    dilution = figures(reports, "modality_dilution_ratio", modality="image")
    assert sorted(mass) == [1, *range(4, 57, 4)]  # step 1 always reports
    for s in mass:
        assert mass[s] == pytest.approx(truth[s]["mass"], rel=1e-5) == pytest.approx(1.0), s
        assert dilution[s] == pytest.approx(truth[s]["dilution"], rel=1e-5), s
    if norm == "token":
        assert truth[56]["dilution"] == pytest.approx(16.96)
    fired = firing(reports)
    assert fired & (LOSS_RULES | {"ParamDrift"}) == fires


def test_loss_failing_on_one_shard_mid_step_never_hangs(tmp_path):
    """The vocabulary shards' maths raise on rank 1 only, in the backward of step 3, while
    rank 0 waits in the shards' collectives: rank 1 still joins them, its loss signal is
    turned off at that report on both ranks together (coverage ``failed`` naming rank 1,
    no loss figure from then on: rank 1's sums of that step miss a micro-batch), the
    other signals and the job go on, within the timeout."""
    got, reports = _run(tmp_path, "head=vocab", "how=logits", "norm=token", "steps=6", "fault=3")
    mass = figures(reports, "loss_weight_mass", objective="main")
    assert sorted(mass) == [1, 2]
    truth = _loss_truth(got)
    for s in (1, 2):
        assert mass[s] == pytest.approx(truth[s]["mass"], rel=1e-5), s
    at3 = {e["signal"]: e for r in reports if r["step"] == 3 for e in r["coverage"]}
    assert (at3["loss"]["active"], at3["loss"]["reason"]) == (False, "failed"), at3["loss"]
    assert "rank 1" in at3["loss"]["detail"]
    assert (got["coverage"]["loss"]["active"], got["coverage"]["loss"]["reason"]) == (False, "failed")
    assert got["coverage"]["optimizer"]["active"] and sorted(figures(reports, "grad_norm")) == list(range(1, 7))
