"""FSDP2 x tensor parallelism on a 2-D mesh, four gloo ranks on the CPU
(``tests/hooks/_fsdp_tp_models.py``): a tiny decoder split over ``tp`` by
``parallelize_module`` and sharded over ``dp`` by ``fully_shard``. The split matrices are
2-D DTensors (each piece held by one rank); the embedding, norms, head and gain are
DTensors on the ``dp`` slice, a copy on each ``tp`` rank, counted ``1/2``. Every
optimizer/params/adam figure of rank 0 is checked against plain torch on the full
tensors, the loss figures against the per-token weights autograd gives (I1's batches:
16% image samples with 20x shorter answers), and I1 and I4 fire where they are present,
never on their twins."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.hooks._fsdp_tp_models import EVERY, IMAGE_ANSWER, IMAGE_ROWS, SAMPLES, STEPS, TEXT_ANSWER
from tests.integrations._alerts import LOSS_RULES, figures, firing, read_reports
from tests.run_configure._helpers import job_env, trainvitals
from tests.support import run_ranks as run_rank_processes

HERE = Path(__file__).resolve().parent
JOB = HERE / "_fsdp_tp_models.py"
WORLD = 4
TIMEOUT_S = 600

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")]


def run_ranks(tmp_path: Path, mode: str, steps: int = STEPS) -> tuple[dict, list[dict]]:
    out = tmp_path / "rank0.json"
    got = run_rank_processes(JOB, out, mode, str(steps), world=WORLD, timeout=TIMEOUT_S)
    return got, read_reports(out.with_suffix(".jsonl"))


def check_figures(got: dict) -> None:
    """Every optimizer/params/adam figure of every report against the full tensors."""
    assert all(got["coverage"][s]["active"] for s in ("optimizer", "params", "adam"))
    assert got["placements"]["blocks.0.q.weight"] == ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]
    assert got["placements"]["blocks.0.o.weight"] == ["Shard(dim=0)", "Shard(dim=1)"]
    assert got["placements"]["emb.weight"] == got["placements"]["gain"] == ["Shard(dim=0)"]  # the dp slice
    assert got["reports"] and len(got["reports"]) == len(got["truths"])
    kinds = {key.split("|")[0] for key in got["truths"][0]}
    assert {"grad_norm", "group_grad_norm", "param_norm", "update_ratio", "param_grad_relative_rms"} <= kinds
    assert {"param_min", "param_max", "param_absmax", "param_drift_log2", "adam_exp_avg_norm"} <= kinds
    assert {"adam_exp_avg_sq_norm", "adam_eps_dominated_ratio", "adam_normalized_update_rms"} <= kinds
    assert 0 < got["truths"][0]["adam_eps_dominated_ratio|group=decay"] < 1  # its counts are checked
    for k, (report, truth) in enumerate(zip(got["reports"], got["truths"], strict=True)):
        for key, want in truth.items():
            assert key in report, (k, key)
            assert report[key] == pytest.approx(want, rel=1e-4, abs=1e-12), (k, key)


def loss_truth(got: dict) -> dict[int, dict[str, float]]:
    """Per step, from autograd's weights at the per-token losses of each data-parallel
    rank: the weight mass (FSDP2 averages the ranks' gradients: the sum over them / dp;
    a summed loss's gradients the job divides by its tokens as well),
    the image share of the gradient weight and the dilution (sample share / that share)."""
    out = {}
    for records in zip(*got["weights"], strict=True):
        total = sum(r["mass"] for r in records)
        image = sum(r["image_mass"] for r in records)
        samples = sum(r["image_samples"] for r in records) / sum(r["samples"] for r in records)
        out[records[0]["step"]] = {
            "mass": total / got["divisor"],
            "image_grad_share": image / total,
            "dilution": samples / (image / total),
        }
    return out


def check_loss(got: dict, reports: list[dict], steps: list[int]) -> dict[int, dict[str, float]]:
    assert got["coverage"]["loss"]["active"]
    assert len(got["weights"]) == got["dp"] == 2  # one tp rank per data-parallel rank
    truth = loss_truth(got)
    mass = figures(reports, "loss_weight_mass", objective="main")
    share = figures(reports, "modality_grad_share_ratio", modality="image")
    dilution = figures(reports, "modality_dilution_ratio", modality="image")
    assert sorted(mass) == steps
    for s in steps:
        assert mass[s] == pytest.approx(truth[s]["mass"], abs=1e-5) == pytest.approx(1.0), s
        assert share[s] == pytest.approx(truth[s]["image_grad_share"], abs=1e-5), s
        assert dilution[s] == pytest.approx(truth[s]["dilution"], rel=1e-5), s
    return truth


REPORTED = [1, *range(EVERY, STEPS + 1, EVERY)]


def test_per_token_loss_every_figure_exact_dilution_and_drift_fire(tmp_path):
    """I1 (the loss averaged over the label tokens) and I4 (the gain in front of the final
    norm, whose only gradient is rounding noise, no weight decay) through ``track_loss``:
    every figure exact, GradientDilution and ParamDrift fire."""
    got, reports = run_ranks(tmp_path, "token")
    check_figures(got)
    truth = check_loss(got, reports, REPORTED)
    image_share = len(IMAGE_ROWS) / SAMPLES
    image_tokens = len(IMAGE_ROWS) * IMAGE_ANSWER
    per_token_share = image_tokens / (image_tokens + (SAMPLES - len(IMAGE_ROWS)) * TEXT_ANSWER)
    assert image_share / per_token_share == pytest.approx(16.96)
    assert truth[STEPS]["dilution"] == pytest.approx(16.96)
    drift = figures(reports, "param_drift_log2", param="gain")
    assert drift[STEPS] > 1
    assert firing(reports) >= {"GradientDilution", "ParamDrift"}
    assert not firing(reports) & (LOSS_RULES - {"GradientDilution"})


def test_per_sample_and_decayed_gain_twin_is_silent(tmp_path):
    """The twins: each sample averaged over its own tokens (the image samples get their
    16% of the gradient), the gain under AdamW's weight decay: nothing of I1 or I4 fires."""
    got, reports = run_ranks(tmp_path, "sample")
    check_figures(got)
    truth = check_loss(got, reports, REPORTED)
    assert truth[STEPS]["image_grad_share"] == pytest.approx(len(IMAGE_ROWS) / SAMPLES)
    assert truth[STEPS]["dilution"] == pytest.approx(1.0)
    assert not firing(reports) & (LOSS_RULES | {"ParamDrift"})


def test_loss_from_logits_and_a_summed_loss_over_the_dp_ranks(tmp_path):
    """``attach(loss_from_logits=True)`` and ``tag_batch``: the head is a plain tensor on
    the ``dp`` slice (the whole vocabulary on every rank), its logits' gradient gives
    every token's weight. The loss is a sum, divided by the job's tokens
    (``loss_scale``): the two tp ranks' sums count once (the data-parallel size is the
    ``dp`` mesh FSDP2 averages over, not the world), the mass is 1."""
    got, reports = run_ranks(tmp_path, "logits", steps=EVERY)
    check_figures(got)
    truth = check_loss(got, reports, [1, EVERY])
    assert truth[EVERY]["dilution"] == pytest.approx(16.96)


def test_trainvitals_run_zero_code(tmp_path):
    """A job that knows nothing of trainvitals under ``trainvitals run`` over
    ``torch.distributed.run``: the optimizer, params and adam signals are active (the 2-D
    layout combined) and the loss figures read from the head's logits are the truth."""
    out = tmp_path / "result.json"
    reports_file = tmp_path / "reports.jsonl"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD)]
    job = [*launcher, str(JOB), "env", "env", "env", str(out), "plain", "3"]
    run = ["run", "--run", "fsdp-tp", "--collector", f"file:{reports_file}", "--every", "1", "--", *job]
    proc = trainvitals(*run, env=job_env(), cwd=tmp_path, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-6000:]
    got = json.loads(out.read_text())
    reports = read_reports(reports_file)
    for r in reports:
        for entry in r["coverage"]:
            if entry["signal"] in ("optimizer", "params", "adam"):
                assert entry["active"], entry
    assert sorted(figures(reports, "grad_norm")) == [1, 2, 3]
    truth = loss_truth(got)
    mass = figures(reports, "loss_weight_mass", objective="main")
    assert sorted(mass) == [2, 3]  # attached at the first step's pre-step hook
    for s in mass:
        assert mass[s] == pytest.approx(truth[s]["mass"], abs=1e-5) == pytest.approx(1.0), s


def test_a_mesh_no_parameter_spans_withholds_the_figures(tmp_path):
    """``fully_shard`` on the ``dp`` slice of a ``(stage, dp)`` mesh, no tensor
    parallelism: no parameter lies on a mesh spanning the job, so whether the ranks
    outside each ``dp`` mesh hold copies (tensor parallel) or other layers (pipeline
    stages) is unknown: optimizer, params and adam withheld, coverage naming the mesh."""
    got, reports = run_ranks(tmp_path, "stage", steps=2)
    for signal in ("optimizer", "params", "adam"):
        entry = got["coverage"][signal]
        assert (entry["active"], entry["reason"]) == (False, "sharded")
        assert "mesh of 2 ranks in a job of 4 (dims dp)" in entry["detail"]
    for report in got["reports"]:
        assert not [k for k in report if k.startswith(("grad_norm", "group_", "param_", "update_ratio", "adam_"))]
    check_loss(got, reports, [1])
