"""Packed rows with the real Trainer and ``DataCollatorWithFlattening`` (position ids;
flash kwargs only; position ids beside an all-ones mask) and a plain loop (restarting
position ids with the model's default ``use_cache=True``, and its ``use_cache=False``
twin), tagged and untagged, on a tiny Llama (sdpa) with the image token in its config
(``_packed_job``): every per-sample figure against the autograd truth per true sample,
GradientDilution on the per-token job and silent on the per-sample twin, the three
leaking layouts flagged with the leak's measured size and its cause, the properly masked
layouts silent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integrations._alerts import figures, firing, read_reports, run_script

HERE = Path(__file__).resolve().parent
JOB = HERE / "_packed_job.py"
STEPS = 22  # GradientDilution needs 20 steps past its threshold: fires at step 21

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"),
]

LEAKS = {"flash": "varlen_ignored", "ones": "mask_beside_positions", "loop": "cache_in_training"}


def check_figures(result: dict, reports: list[dict]) -> None:
    """Each reported step's image figures within 1% of the truth per true sample."""
    truth = {t["step"]: t for t in result["truth"]}
    img = {"modality": "image"}
    got = {
        "grad_share": figures(reports, "modality_grad_share_ratio", **img),
        "sample_share": figures(reports, "modality_sample_share_ratio", **img),
        "token_share": figures(reports, "modality_token_share_ratio", **img),
        "dilution": figures(reports, "modality_dilution_ratio", **img),
        "exponent": figures(reports, "loss_norm_exponent"),
    }
    assert sorted(got["grad_share"]) == sorted(truth), sorted(got["grad_share"])
    for name, series in got.items():
        for step, value in series.items():
            want = truth[step][name]
            assert value == pytest.approx(want, rel=0.01, abs=0.01 if name == "exponent" else 0), (name, step)
    kinds = {e["kind"] for r in reports for e in r.get("events", [])}
    assert not kinds & {"modality_without_label_tokens", "loss_samples_withheld", "loss_sample_mixed_modality"}


@pytest.mark.parametrize("tagged", [0, 1], ids=["untagged", "tagged"])
@pytest.mark.parametrize("layout", ["positions", "flash", "ones", "loop"])
def test_per_token_packed_jobs_fire_dilution_and_the_leaking_ones_the_leak(tmp_path, layout, tagged):
    result = run_script(JOB, tmp_path, f"out_dir={tmp_path / 'run'}", f"layout={layout}", f"tagged={tagged}")
    reports = read_reports(result["reports"])
    check_figures(result, reports)
    assert all(t["dilution"] > 5 for t in result["truth"])  # 10 long text and 2 short image samples
    leak = figures(reports, "packing_leak_logit_change", cause=LEAKS.get(layout, "unknown"))
    first = result["truth"][0]
    assert list(leak) == [1]  # probed at the first report step (then every 1000 steps)
    if layout in LEAKS:
        assert first["leak"] > 1e-3
        assert leak[1] == pytest.approx(first["leak"], rel=0.01)
        assert figures(reports, "packing_leak_sign", cause=LEAKS[layout])[1] == 1.0
        assert firing(reports) >= {"GradientDilution", "PackedSamplesLeak"}
    else:
        assert first["leak"] == 0.0 and leak[1] == 0.0
        assert not figures(reports, "packing_leak_sign", cause="mask_beside_positions")
        assert "PackedSamplesLeak" not in firing(reports)
        assert "GradientDilution" in firing(reports)


@pytest.mark.parametrize("layout", ["positions", "loopmask"])
def test_the_per_sample_twin_is_silent(tmp_path, layout):
    result = run_script(JOB, tmp_path, f"out_dir={tmp_path / 'run'}", f"layout={layout}", "norm=sample")
    reports = read_reports(result["reports"])
    check_figures(result, reports)
    assert all(t["dilution"] == pytest.approx(1.0, rel=1e-3) for t in result["truth"])
    assert figures(reports, "packing_leak_logit_change", cause="unknown") == {1: 0.0}
    assert not firing(reports) & {"GradientDilution", "PackedSamplesLeak", "LossNormalizationDilutes"}


def test_trainvitals_run_reads_the_packed_samples_and_probes_the_leak(tmp_path):
    """The plain loop with use_cache=True, attaching nothing itself, under ``trainvitals
    run``: per-true-sample figures from its position ids, image samples by the image
    token, the leak measured at the first report step it attached for."""
    import sys

    from tests.run_configure._helpers import job_env, trainvitals

    out = tmp_path / "reports.jsonl"
    proc = trainvitals(
        "run",
        "--run",
        "packed",
        "--collector",
        f"file:{out}",
        "--every",
        "1",
        "--",
        sys.executable,
        str(JOB),
        str(tmp_path / "result.json"),
        f"out_dir={tmp_path / 'run'}",
        "layout=loop",
        "own=0",
        env=job_env(HF_HUB_OFFLINE="1"),
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    reports = read_reports(out)
    check_figures({"truth": [t for t in result["truth"] if t["step"] >= 2]}, reports)
    leak = figures(reports, "packing_leak_logit_change", cause="cache_in_training")
    assert list(leak) == [2]  # attached at step 1's optimizer step: step 2 is its first report
    assert leak[2] == pytest.approx(result["truth"][1]["leak"], rel=0.01)
    assert firing(reports) >= {"GradientDilution", "PackedSamplesLeak"}
