"""megatron-core 0.16.1's ``GPTModel`` through ``get_forward_backward_func()``, its DDP,
``finalize_model_grads`` and ``get_megatron_optimizer`` on gloo (``_megatron_job``), at
world size 1 and 2, with and without ``calculate_per_token_loss``, through
``attach(loss_from_logits=True)`` and ``trainvitals run``; against the true per-token
weights autograd gives at the model's per-token loss output.

Megatron's logits are sequence-first, its output layer a ``ColumnParallelLinear`` and
its cross entropy overwrites float32 logits in place: the weights are read at the
per-token losses ``GPTModel`` returns, the logits' gradient checks them. Its optimizer
(a ``ChainedOptimizer`` around ``FP32Optimizer`` around AdamW) is taken as it is, its
parameters named without DDP's ``module.``. The default (each micro-batch averaged over
its own tokens, one sample each: per-sample weighting) fires nothing; per-token loss on
a batch of long text and short image answers fires GradientDilution."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.integrations._alerts import LOSS_RULES, figures, firing, read_reports
from tests.run_configure._helpers import job_env, trainvitals

HERE = Path(__file__).resolve().parent
JOB = HERE / "_megatron_job.py"

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]  # Megatron, ranks, a launcher


def _launch(world: int, out: Path, *options: str) -> list[str]:
    # torchrun as a module of this Python (a torchrun script may carry another one's shebang)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    return [*launcher, str(JOB), str(out), *options]


def _truth(result: dict, per_token: bool) -> dict[int, dict]:
    """Per step: the effective weight mass (after Megatron's post-backward scaling: the
    DDP average, or the division by the step's tokens over all ranks), the image share of
    the gradient and of the samples."""
    world = result["world"]
    out = {}
    for k in range(len(result["truth"][0])):
        micro = [m for rank in result["truth"] for m in rank[k]["micro"]]
        total = sum(m["mass"] for m in micro)
        tokens = sum(m["tokens"] for m in micro)
        image = sum(m["mass"] for m in micro if m["image"])
        out[k + 1] = {
            "mass": total / tokens if per_token else total / world,
            "image_grad_share": image / total,
            "image_samples": sum(m["image"] for m in micro) / len(micro),
            "spread": max(m["wmax"] for m in micro) / min(m["wmin"] for m in micro),
        }
    return out


def _check(reports: list[dict], truth: dict[int, dict], per_token: bool, steps: list[int], tagged: bool) -> None:
    mass = figures(reports, "loss_weight_mass", objective="main")
    spread = figures(reports, "token_weight_spread_ratio", objective="main")
    intended = figures(reports, "token_weight_spread_ratio", objective="main", normalization="sample")
    micro = figures(reports, "microbatches")
    share = figures(reports, "modality_grad_share_ratio", modality="image")
    assert sorted(mass) == steps
    for s in steps:
        assert mass[s] == pytest.approx(truth[s]["mass"], rel=1e-5), s
        assert mass[s] == pytest.approx(1.0, rel=1e-5), s
        assert micro[s] == 4, s
        if per_token:
            assert spread[s] == pytest.approx(truth[s]["spread"], rel=1e-5) == 1.0, s
        else:  # per-sample weighting: unequal token weights are the intent, reported as such
            assert s not in spread
            assert intended[s] == pytest.approx(truth[s]["spread"], rel=1e-5), s
        if tagged:
            assert share[s] == pytest.approx(truth[s]["image_grad_share"], rel=1e-5), s


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("per_token", [0, 1], ids=["per-sample-default", "calculate_per_token_loss"])
def test_megatron_through_attach(tmp_path, per_token, world):
    steps = 24 if per_token else 21  # GradientDilution needs 20 reports in a row
    out = tmp_path / "result.json"
    proc = trainvitals_free(_launch(world, out, f"per_token={per_token}", "mode=attach", f"steps={steps}"), tmp_path)
    result = json.loads(out.read_text())
    reports = read_reports(out.with_suffix(".jsonl"))
    truth = _truth(result, bool(per_token))
    _check(reports, truth, bool(per_token), list(range(1, steps + 1)), tagged=True)
    names = {s["labels"].get("param") for r in reports for s in r.get("samples", []) if "param" in s["labels"]}
    assert names and not any(n.startswith("module.") for n in names)
    assert names <= set(result["params"])
    if per_token:  # 3 image tokens against 40 text tokens per pair of samples
        assert truth[steps]["image_grad_share"] == pytest.approx(3 / 43, rel=1e-6)
    fired = firing(reports) & LOSS_RULES
    assert fired == ({"GradientDilution"} if per_token else set()), proc
    kinds = {e["kind"] for r in reports for e in r.get("events", [])}
    assert "loss_not_cross_entropy" not in kinds


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("per_token", [0, 1], ids=["per-sample-default", "calculate_per_token_loss"])
def test_megatron_under_trainvitals_run(tmp_path, per_token, world):
    out = tmp_path / "result.json"
    reports_file = tmp_path / "reports.jsonl"
    proc = trainvitals(
        "run",
        "--run",
        "megatron",
        "--collector",
        f"file:{reports_file}",
        "--every",
        "1",
        "--",
        *_launch(world, out, f"per_token={per_token}", "mode=plain", "steps=4"),
        env=job_env(),
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "loss accounting from the logits of 'output_layer'" in proc.stderr
    result = json.loads(out.read_text())
    reports = read_reports(reports_file)
    # Attached at the first step's pre-step hook: loss figures from step 2 on.
    _check(reports, _truth(result, bool(per_token)), bool(per_token), [2, 3, 4], tagged=False)
    assert not firing(reports) & LOSS_RULES


def trainvitals_free(cmd: list[str], cwd: Path) -> str:
    import subprocess

    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=job_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stderr


def test_megatron_default_with_several_samples_per_micro_batch_is_a_mean_of_means(tmp_path):
    """Per-sample weighting is Megatron's intent only with one sample per micro-batch:
    two samples each (two text, or two image micro-batches: 80 against 6 label tokens),
    each micro-batch averaged over its own tokens, is a mean of means and pages."""
    out = tmp_path / "result.json"
    trainvitals_free(_launch(1, out, "per_token=0", "mode=attach", "steps=52", "mbs=2"), tmp_path)
    result = json.loads(out.read_text())
    reports = read_reports(out.with_suffix(".jsonl"))
    spread = figures(reports, "token_weight_spread_ratio", objective="main")
    truth = _truth(result, False)
    for s in range(1, 53):
        assert spread[s] == pytest.approx(truth[s]["spread"], rel=1e-5) == pytest.approx(80 / 6), s
    assert firing(reports) & LOSS_RULES == {"MeanOfMeansLoss"}


@pytest.mark.parametrize("per_token", [0, 1], ids=["per-sample-default", "calculate_per_token_loss"])
def test_megatron_track_loss_in_the_loss_function_reads_the_same_intent(tmp_path, per_token):
    """``track_loss`` called in Megatron's loss function on its per-token losses [1, S]
    (``attach`` without ``loss_from_logits``): the default path (one sample per micro-batch,
    each averaged over its own tokens) is per-sample weighting, as the zero-code path reads
    it: its spread (40 text against 3 image label tokens) is reported as that intent and
    MeanOfMeansLoss stays silent past its 50 steps; with ``calculate_per_token_loss`` the
    spread is 1 and GradientDilution still fires on the short image answers."""
    steps = 24 if per_token else 52
    out = tmp_path / "result.json"
    trainvitals_free(_launch(1, out, f"per_token={per_token}", "mode=attach", f"steps={steps}", "track=1"), tmp_path)
    result = json.loads(out.read_text())
    reports = read_reports(out.with_suffix(".jsonl"))
    truth = _truth(result, bool(per_token))
    mass = figures(reports, "loss_weight_mass", objective="main")
    plain = figures(reports, "token_weight_spread_ratio", objective="main")
    intended = figures(reports, "token_weight_spread_ratio", objective="main", normalization="sample")
    share = figures(reports, "modality_grad_share_ratio", modality="image")
    assert sorted(mass) == list(range(1, steps + 1))
    for s in range(1, steps + 1):
        assert mass[s] == pytest.approx(truth[s]["mass"], rel=1e-5) == pytest.approx(1.0, rel=1e-5), s
        assert share[s] == pytest.approx(truth[s]["image_grad_share"], rel=1e-5), s
        if per_token:
            assert plain[s] == pytest.approx(truth[s]["spread"], rel=1e-5) == 1.0 and s not in intended, s
        else:
            assert intended[s] == pytest.approx(truth[s]["spread"], rel=1e-5) == pytest.approx(40 / 3), s
            assert s not in plain, s
    assert firing(reports) & LOSS_RULES == ({"GradientDilution"} if per_token else set())
