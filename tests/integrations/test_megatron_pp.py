"""megatron-core 0.16.1's ``GPTModel`` with ``pipeline_model_parallel_size=2`` on two gloo
ranks, trained with Megatron's own pipelined schedule (``_megatron_job`` with ``pp=2``): the
first stage holds the embedding and layer 0, the last layer 1, the final layernorm and the
output layer (each stage names its layer ``decoder.layers.0``; the figures use Megatron's
global layer numbers). Rank 0, the only sender, is on the first stage.

Every optimizer/params/adam figure of rank 0 is checked against the same figure computed
with plain torch from every stage's full tensors, gathered to rank 0 by the job
(``tests/hooks/_tp_models.truth``): the global norms sum over both stages' parameters, the
per-parameter rows cover the last stage's parameters too, and ``param_grad_relative_rms``
divides by the median over all the model's parameters. The loss figures are checked
against the per-token weights autograd gives at the last stage's per-token losses. I1
(``calculate_per_token_loss``) pages, I4 (a gain on the last stage whose true gradient is
zero, walked by Adam) pages; their twins are silent. Four ranks (TP=2 x PP=2) too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integrations._alerts import LOSS_RULES, figures, firing, read_reports
from tests.integrations.test_megatron_tp import _check_figures, _loss_truth
from tests.run_configure._helpers import job_env, trainvitals

HERE = Path(__file__).resolve().parent
JOB = HERE / "_megatron_job.py"

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]  # Megatron, ranks, a launcher


def _run(tmp_path: Path, *options: str, world: int = 2) -> tuple[dict, list[dict], str]:
    out = tmp_path / "result.json"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    cmd = [*launcher, str(JOB), str(out), "mode=attach", "pp=2", *options]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=job_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text()), read_reports(out.with_suffix(".jsonl")), proc.stderr


def _check_stages(got: dict) -> None:
    """Every figure exact, and among them the last stage's parameters (rank 0 holds none)."""
    _check_figures(got)
    truth = got["truths"][0]
    for key in (
        "param_max|param=decoder.layers.1.input_layernorm.weight",  # the last stage's layer, globally numbered
        "param_max|param=decoder.layers.0.input_layernorm.weight",
        "param_grad_relative_rms|param=decoder.final_layernorm.weight",
        "adam_normalized_update_rms|param=decoder.layers.1.mlp.linear_fc2.bias",
    ):
        assert key in truth, key


def _check_loss(
    reports: list[dict], truth: dict[int, dict], steps: list[int], *, dilution: bool = False, shares: bool = True
) -> None:
    mass = figures(reports, "loss_weight_mass", objective="main")
    share = figures(reports, "modality_grad_share_ratio", modality="image")
    ratio = figures(reports, "modality_dilution_ratio", modality="image")
    assert sorted(mass) == steps
    for s in steps:
        assert mass[s] == pytest.approx(truth[s]["mass"], rel=1e-5) == pytest.approx(1.0), s
        if shares:  # (modalities tagged)
            assert share[s] == pytest.approx(truth[s]["image_grad_share"], rel=1e-5), s
        if dilution:
            assert ratio[s] == pytest.approx(truth[s]["dilution"], rel=1e-5), s


def test_pp2_per_token_every_figure_exact_dilution_and_gain_drift_page(tmp_path):
    """``calculate_per_token_loss`` (I1) and a gain on the last stage that Adam walks (I4),
    through ``attach(loss_from_logits=True)`` on both stages (the first reads no logits)."""
    got, reports, _ = _run(tmp_path, "per_token=1", "steps=30", "figures=1", "logits=1", "gain=1")
    _check_stages(got)
    assert "param_drift_log2|param=gain" in got["truths"][0]
    assert all(got["coverage"][s]["active"] for s in ("loss", "optimizer", "params", "adam"))
    truth = _loss_truth(got, True)
    _check_loss(reports, truth, list(range(1, 31)), dilution=True)
    assert truth[21]["dilution"] == pytest.approx(0.5 * 43 / 3)  # 3 image tokens against 40 text tokens
    drift = figures(reports, "param_drift_log2", param="gain")
    assert drift[30] > 1 and drift[30] == pytest.approx(got["truths"][-1]["param_drift_log2|param=gain"], rel=1e-4)
    kinds = {e["kind"] for r in reports for e in r.get("events", [])}
    assert "loss_not_cross_entropy" not in kinds
    fired = firing(reports)
    assert fired & LOSS_RULES == {"GradientDilution"}
    assert "ParamDrift" in fired


def test_pp2_per_sample_default_and_zeroed_gain_are_silent(tmp_path):
    """The twins: Megatron's default per-sample loss, the head named as the wrapped model
    spells it (found on the last stage, nothing to find on the first), and the gain whose
    gradient is left at its true zero (I4's fix)."""
    got, reports, _ = _run(tmp_path, "per_token=0", "steps=30", "logits=module.output_layer", "gain=2")
    assert got["coverage"]["loss"]["active"]
    _check_loss(reports, _loss_truth(got, False), list(range(1, 31)))
    drift = figures(reports, "param_drift_log2", param="gain")
    assert sorted(drift) == list(range(1, 31)) and max(drift.values()) == 0.0
    fired = firing(reports)
    assert not fired & LOSS_RULES
    assert "ParamDrift" not in fired


def test_pp2_track_loss_on_the_last_stage_only(tmp_path):
    """``track_loss`` called in the loss function, which only the last stage runs."""
    got, reports, _ = _run(tmp_path, "per_token=1", "steps=4", "track=1")
    assert got["coverage"]["loss"]["active"]
    _check_loss(reports, _loss_truth(got, True), [1, 2, 3, 4], dilution=True)


def test_trainvitals_run_at_pp2_reads_the_last_stage_head(tmp_path):
    """Zero-code: a job that knows nothing of trainvitals, under ``trainvitals run``."""
    out = tmp_path / "result.json"
    reports_file = tmp_path / "reports.jsonl"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    job = [*launcher, str(JOB), str(out), "per_token=1", "mode=plain", "steps=4", "pp=2"]
    run = ["run", "--run", "megatron", "--collector", f"file:{reports_file}", "--every", "1", "--", *job]
    proc = trainvitals(*run, env=job_env(), cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "loss accounting from the logits of 'output_layer'" in proc.stderr
    reports = read_reports(reports_file)
    _check_loss(
        reports, _loss_truth(json.loads(out.read_text()), True), [2, 3, 4], shares=False
    )  # from step 1's pre-step
    assert sorted(figures(reports, "grad_norm")) == [1, 2, 3, 4]
    assert sorted(figures(reports, "param_max", param="decoder.layers.1.input_layernorm.weight")) == [1, 2, 3, 4]


def test_tp2_by_pp2_on_four_ranks_every_figure_exact(tmp_path):
    """Four ranks: a TP=2 split on each of two stages. The last stage's output layer is
    vocab-parallel (its zero-code reading combines over its own tensor-parallel group)."""
    got, reports, _ = _run(tmp_path, "tp=2", "per_token=1", "steps=3", "figures=1", "logits=1", world=4)
    _check_stages(got)
    _check_loss(reports, _loss_truth(got, True), [1, 2, 3], dilution=True)


def test_pp2_by_dp2_on_four_ranks_every_figure_exact(tmp_path):
    """Four ranks: two data-parallel copies of a PP=2 model. Each stage's parameters count
    1/2 on each copy; Megatron's default loss is averaged over the data-parallel ranks."""
    got, reports, _ = _run(tmp_path, "per_token=0", "steps=3", "figures=1", "logits=1", "gain=1", world=4)
    assert got["world"] == 2  # the job writes the data-parallel size
    _check_stages(got)
    _check_loss(reports, _loss_truth(got, False), [1, 2, 3])


def test_pp2_without_loss_accounting_reads_not_requested(tmp_path):
    """A pipeline job that asks for no loss accounting: every stage still lays out the loss
    sums (the reports' vectors alike), and the loss reads ``not_requested``, no blind spot;
    the optimizer, params and adam figures are active (no longer withheld)."""
    _, reports, stderr = _run(tmp_path, "per_token=1", "steps=3", "logits=0")
    assert [r["step"] for r in reports if r.get("samples") is not None][-1] == 3
    for r in reports[:-1]:  # (the run_end report repeats the last one's)
        coverage = {e["signal"]: e for e in r["coverage"]}
        assert all(coverage[s]["active"] for s in ("optimizer", "params", "adam")), coverage
        assert (coverage["loss"]["active"], coverage["loss"]["reason"]) == (False, "not_requested")
        assert not any(s["name"].startswith("loss") for s in r.get("samples", []))
    assert figures(reports, "grad_norm") and not firing(reports)
    closing = [line for line in stderr.splitlines() if "closed after 3 optimizer step(s)" in line]
    assert closing and all("not requested: loss" in line for line in closing), closing
