"""megatron-core 0.16.1's ``GPTModel`` with ``tensor_model_parallel_size=2`` on two gloo
ranks (``_megatron_job`` with ``tp=2``): Megatron's shards are plain tensors marked
``tensor_model_parallel`` / ``partition_dim``, its gradients in ``main_grad``, its output
layer a ``ColumnParallelLinear`` whose logits are a vocabulary shard, its cross entropy
vocab-parallel.

Every optimizer/params/adam figure of rank 0 is checked against the same figure computed
with plain torch from the full tensors (each split gathered over the tensor-parallel group
along its ``partition_dim``; ``tests/hooks/_tp_models.truth``): a split counts once per
rank, a replicated norm or row-parallel bias once in all. The loss figures are checked
against the per-token weights autograd gives at the model's per-token losses (recorded by
the job, one tensor-parallel rank per data-parallel rank: the group's ranks see the same
tokens), through ``attach(loss_from_logits=True)`` and the head named as the user's
wrapped model spells it (``module.output_layer``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integrations._alerts import LOSS_RULES, figures, firing, read_reports
from tests.run_configure._helpers import job_env, trainvitals

HERE = Path(__file__).resolve().parent
JOB = HERE / "_megatron_job.py"

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]  # Megatron, ranks, a launcher


def _run(tmp_path: Path, *options: str, world: int = 2) -> tuple[dict, list[dict]]:
    out = tmp_path / "result.json"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    cmd = [*launcher, str(JOB), str(out), "mode=attach", "tp=2", *options]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=job_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text()), read_reports(out.with_suffix(".jsonl"))


def _check_figures(got: dict) -> None:
    assert all(got["coverage"][s]["active"] for s in ("optimizer", "params", "adam"))
    assert got["reports"] and len(got["reports"]) == len(got["truths"])
    kinds = {key.split("|")[0] for key in got["truths"][0]}
    assert {"grad_norm", "group_grad_norm", "param_norm", "update_ratio", "param_grad_relative_rms"} <= kinds
    assert {"param_min", "param_max", "param_absmax", "param_drift_log2", "adam_exp_avg_norm"} <= kinds
    assert {"adam_exp_avg_sq_norm", "adam_eps_dominated_ratio", "adam_normalized_update_rms"} <= kinds
    # a 1D split (column-parallel bias) and a replicated norm are among the figures checked
    assert "param_max|param=decoder.layers.0.mlp.linear_fc1.bias" in got["truths"][0]
    assert "param_max|param=decoder.final_layernorm.weight" in got["truths"][0]
    for k, (report, truth) in enumerate(zip(got["reports"], got["truths"], strict=True)):
        for key, want in truth.items():
            assert key in report, (k, key)
            assert report[key] == pytest.approx(want, rel=1e-4, abs=1e-12), (k, key)


def _loss_truth(result: dict, per_token: bool) -> dict[int, dict]:
    """Per step, from the weights at the per-token losses: the weight mass after
    Megatron's scaling (the division by the step's tokens over the data-parallel ranks,
    or the average over them), the image share of the gradient, the dilution."""
    dp = result["world"]  # the job writes the data-parallel size
    out = {}
    for k in range(len(result["truth"][0])):
        micro = [m for rank in result["truth"] for m in rank[k]["micro"]]
        total = sum(m["mass"] for m in micro)
        tokens = sum(m["tokens"] for m in micro)
        image = sum(m["mass"] for m in micro if m["image"])
        samples = sum(m["image"] for m in micro) / len(micro)
        out[k + 1] = {
            "mass": total / tokens if per_token else total / dp,
            "image_grad_share": image / total,
            "dilution": samples / (image / total),
        }
    return out


def test_calculate_per_token_loss_at_tp2_every_figure_exact_and_dilution_pages(tmp_path):
    """I1 (``calculate_per_token_loss``) and I4 (a replicated ``[1]`` gain whose true
    gradient is zero, walked by Adam) at TP=2: every figure exact, both page."""
    got, reports = _run(tmp_path, "per_token=1", "steps=30", "figures=1", "logits=1", "gain=1")
    _check_figures(got)
    assert "param_drift_log2|param=gain" in got["truths"][0]
    drift = figures(reports, "param_drift_log2", param="gain")
    assert drift[30] > 1 and drift[30] == pytest.approx(got["truths"][-1]["param_drift_log2|param=gain"], rel=1e-4)
    assert got["coverage"]["loss"]["active"]
    truth = _loss_truth(got, True)
    mass = figures(reports, "loss_weight_mass", objective="main")
    share = figures(reports, "modality_grad_share_ratio", modality="image")
    dilution = figures(reports, "modality_dilution_ratio", modality="image")
    assert sorted(mass) == list(range(1, 31))
    for s in range(1, 31):
        assert mass[s] == pytest.approx(truth[s]["mass"], rel=1e-5) == pytest.approx(1.0), s
        assert share[s] == pytest.approx(truth[s]["image_grad_share"], rel=1e-5), s
        assert dilution[s] == pytest.approx(truth[s]["dilution"], rel=1e-5), s
    assert truth[21]["dilution"] == pytest.approx(0.5 * 43 / 3)  # 3 image tokens against 40 text tokens
    kinds = {e["kind"] for r in reports for e in r.get("events", [])}
    assert "loss_not_cross_entropy" not in kinds
    assert firing(reports) & LOSS_RULES == {"GradientDilution"}
    assert "ParamDrift" in firing(reports)


def test_per_sample_default_at_tp2_named_head_is_silent(tmp_path):
    """Megatron's default (each one-sample micro-batch averaged over its tokens) is the
    per-sample intent: the twin, with the head named as the wrapped model spells it, and
    the gain's gradient left at its true zero (I4's fix): it never moves."""
    got, reports = _run(tmp_path, "per_token=0", "steps=30", "logits=module.output_layer", "gain=2")
    assert got["coverage"]["loss"]["active"]
    truth = _loss_truth(got, False)
    mass = figures(reports, "loss_weight_mass", objective="main")
    share = figures(reports, "modality_grad_share_ratio", modality="image")
    assert sorted(mass) == list(range(1, 31))
    for s in range(1, 31):
        assert mass[s] == pytest.approx(truth[s]["mass"], rel=1e-5) == pytest.approx(1.0), s
        assert share[s] == pytest.approx(truth[s]["image_grad_share"], rel=1e-5), s
    kinds = {e["kind"] for r in reports for e in r.get("events", [])}
    assert "loss_not_cross_entropy" not in kinds
    assert not firing(reports) & LOSS_RULES
    assert "ParamDrift" not in firing(reports)
    assert max(figures(reports, "param_drift_log2", param="gain").values()) == 0


def test_trainvitals_run_at_tp2_reads_the_vocab_parallel_head(tmp_path):
    """Zero-code: a job that knows nothing of trainvitals, under ``trainvitals run``."""
    out = tmp_path / "result.json"
    reports_file = tmp_path / "reports.jsonl"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    job = [*launcher, str(JOB), str(out), "per_token=1", "mode=plain", "steps=4", "tp=2"]
    run = ["run", "--run", "megatron", "--collector", f"file:{reports_file}", "--every", "1", "--", *job]
    proc = trainvitals(*run, env=job_env(), cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "loss accounting from the logits of 'output_layer'" in proc.stderr
    truth = _loss_truth(json.loads(out.read_text()), True)
    reports = read_reports(reports_file)
    mass = figures(reports, "loss_weight_mass", objective="main")
    grad_norm = figures(reports, "grad_norm")
    assert sorted(mass) == [2, 3, 4]  # attached at the first step's pre-step hook
    for s in (2, 3, 4):
        assert mass[s] == pytest.approx(truth[s]["mass"], rel=1e-5) == pytest.approx(1.0), s
    assert sorted(grad_norm) == [1, 2, 3, 4]
    kinds = {e["kind"] for r in reports for e in r.get("events", [])}
    assert "loss_not_cross_entropy" not in kinds


def test_tp2_by_dp2_on_four_ranks_every_figure_exact(tmp_path):
    """Four ranks: two data-parallel copies of a TP=2 model. A split counts 1/2 (two
    data-parallel copies), a replicated tensor 1/4; Megatron's default loss is averaged
    over the data-parallel ranks, so the weight mass divides by 2, not by the world's 4."""
    got, reports = _run(tmp_path, "per_token=0", "steps=3", "figures=1", "logits=1", world=4)
    assert got["world"] == 2  # the job writes the data-parallel size
    _check_figures(got)
    truth = _loss_truth(got, False)
    mass = figures(reports, "loss_weight_mass", objective="main")
    share = figures(reports, "modality_grad_share_ratio", modality="image")
    assert sorted(mass) == [1, 2, 3]
    for s in (1, 2, 3):
        assert mass[s] == pytest.approx(truth[s]["mass"], rel=1e-5) == pytest.approx(1.0), s
        assert share[s] == pytest.approx(truth[s]["image_grad_share"], rel=1e-5), s
