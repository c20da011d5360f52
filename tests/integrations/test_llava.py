"""A tiny LLaVA under the Hugging Face Trainer with ``TrainvitalsCallback()`` and no
modality field (``_llava_job``): the model's config names its image token, so samples are
classed by their input ids, and the image share of samples and of the gradient equal the
truth recorded independently (a micro-batch with pixel values is an image sample). Short
image answers under the Trainer's per-token normalization fire GradientDilution; answers
as long as the text samples (the healthy twin) fire nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integrations._alerts import LOSS_RULES, figures, firing, read_reports, run_script

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.slow  # a fresh Python importing torch and transformers


def run_job(tmp_path: Path, *options: str) -> dict:
    return run_script(HERE / "_llava_job.py", tmp_path, *options)


@pytest.mark.parametrize(("answer", "fires"), [(1, {"GradientDilution"}), (28, set())], ids=["short", "healthy"])
def test_image_samples_are_found_by_the_models_image_token(tmp_path, answer, fires):
    result = run_job(tmp_path, f"answer={answer}", "steps=24", "every=1")
    assert result["modalities"] == ["text", "image"]
    reports = read_reports(result["reports"])
    samples = figures(reports, "modality_sample_share_ratio", modality="image")
    grad = figures(reports, "modality_grad_share_ratio", modality="image")
    mass = figures(reports, "loss_weight_mass", objective="main")
    for t in result["truth"]:
        s = t["step"]
        assert samples[s] == t["image_samples"] == 0.5, s
        assert grad[s] == pytest.approx(t["image_grad_share"], rel=1e-5), s
        assert mass[s] == pytest.approx(t["mass"], rel=1e-5), s
    expected = 2 / 31 if answer == 1 else 0.5  # label tokens after the shift: 2 of 2 + 29, or 29 of 58
    assert grad[24] == pytest.approx(expected, rel=1e-5)
    assert firing(reports) & LOSS_RULES == fires
    kinds = {e["kind"] for r in reports for e in r.get("events", [])}
    assert not kinds & {"loss_unknown_modality_code", "modality_without_label_tokens", "loss_sample_mixed_modality"}
