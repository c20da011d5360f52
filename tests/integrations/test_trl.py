"""TRL's ``SFTTrainer`` on its default path, the fused LM head that never calls the
``lm_head`` module, with the Hugging Face callback (``_trl_job``): the figures equal the
true per-token weights recorded independently; the default loss (normalized over the
accumulated batch) fires nothing, a model class with ``accepts_loss_kwargs = False`` (a
mean of means) fires MeanOfMeansLoss."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integrations._alerts import LOSS_RULES, figures, firing, read_reports, run_script

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.slow  # a fresh Python importing torch, transformers and TRL


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, dict]:
    """Both jobs, one after the other in one fresh Python (TRL is imported once): 60
    optimizer steps each, reported every 4th; model name -> its result."""
    return run_script(
        HERE / "_trl_job.py", tmp_path_factory.mktemp("trl"), "models=default,mean-of-means", "steps=60", "every=4"
    )


def check_against_truth(result: dict, every: int) -> list[dict]:
    reports = read_reports(result["reports"])
    mass = figures(reports, "loss_weight_mass", objective="main")
    micro = figures(reports, "microbatches")
    spread = figures(reports, "token_weight_spread_ratio", objective="main")
    truth = {t["step"]: t for t in result["truth"]}
    reported = [s for s in truth if s == 1 or s % every == 0]
    assert reported and sorted(mass) == reported, (sorted(mass), reported)
    for s in reported:
        t = truth[s]
        assert mass[s] == pytest.approx(t["mass"], rel=1e-5), s
        assert micro[s] == t["microbatches"] == 4, s
        assert spread.get(s) == (None if t["spread"] is None else pytest.approx(t["spread"], rel=1e-5)), s
    return reports


def test_sft_trainer_default_path_equals_the_truth_and_nothing_fires(jobs):
    result = jobs["default"]
    assert result["fused_forwards"] == 240  # every micro-batch went through the fused head
    reports = check_against_truth(result, every=4)
    assert all(t["mass"] == pytest.approx(1.0, rel=1e-5) for t in result["truth"])
    assert all(t["spread"] == pytest.approx(1.0, rel=1e-5) for t in result["truth"])
    assert not firing(reports) & LOSS_RULES


def test_a_model_class_without_loss_kwargs_is_a_mean_of_means_and_fires(jobs):
    result = jobs["mean-of-means"]
    reports = check_against_truth(result, every=4)
    assert all(t["mass"] == pytest.approx(1.0, rel=1e-5) for t in result["truth"])
    assert max(t["spread"] for t in result["truth"]) > 4  # 29 label tokens against 5
    assert firing(reports) & LOSS_RULES == {"MeanOfMeansLoss"}
