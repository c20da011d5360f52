"""What the job intends: objectives and their declared weights (I2 without false
pages on weighted losses), the declared normalization (I1/I3 without false pages on
deliberate schemes), and modalities marked on input positions only. Every value is
checked against a hand calculation."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainvitals.hooks import attach

pytestmark = pytest.mark.usefixtures("loss_emission")  # both emission paths: tests/conftest.py

VOCAB = 16


def model_and_opt():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))
    return model, torch.optim.SGD(model.parameters(), lr=0.0)


def batch(lengths: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(0, VOCAB, (len(lengths), width), generator=g)
    mask = torch.arange(width) < torch.tensor(lengths)[:, None]
    return ids, ids.roll(-1, 1), mask


def per_token(model, ids, labels):
    return F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)


def one_step(mon, model, opt, micro: list[tuple[float, dict]], lengths=(6, 4, 5, 3)):
    """One optimizer step of len(micro) micro-batches: each (loss coefficient, track_loss
    keywords); the micro-batch loss is coefficient * the token mean over the batch."""
    for k, (coef, kwargs) in enumerate(micro):
        ids, labels, mask = batch(list(lengths), seed=k)
        pt = per_token(model, ids, labels)
        mon.track_loss(pt, modality="text", mask=mask, **kwargs)
        (coef * (pt * mask).sum() / mask.sum()).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize(
    ("case", "micro", "mass", "exponent"),
    [
        # Undivided over 4 micro-batches: sum w = 4 x 1; log 4 / log 4 = 1.
        ("undivided", [(1.0, {})] * 4, 4.0, 1.0),
        # Divided once: 4 x 1/4 = 1; log 1 = 0.
        ("normalized", [(0.25, {})] * 4, 1.0, 0.0),
        # Divided twice: 4 x 1/16 = 1/4; log(1/4) / log 4 = -1.
        ("divided-twice", [(1 / 16, {})] * 4, 0.25, -1.0),
        # A hard-label term weighted 2, one micro-batch: mass 2, no exponent (N = 1).
        ("weight-2-one-micro-batch", [(2.0, {})], 2.0, None),
        # ... declared: judged against its weight, 2 / 2 = 1.
        ("weight-2-declared", [(2.0, {"weight": 2.0})], 1.0, None),
        # KD scaled by tau^2 = 16, divided over 4: mass 16, log 16 / log 4 = 2.
        ("kd-tau-squared", [(4.0, {})] * 4, 16.0, 2.0),
        # A deliberate alpha = 0.1 over 2 micro-batches, divided: mass 0.1, log 0.1 / log 2.
        ("alpha-0.1", [(0.05, {})] * 2, 0.1, math.log(0.1) / math.log(2)),
    ],
)
def test_weight_mass_and_its_accumulation_exponent(case, micro, mass, exponent):
    model, opt = model_and_opt()
    with attach(model, opt, run=case, sink="null", every=1, modalities=("text",)) as mon:
        one_step(mon, model, opt, micro)
        assert mon.value("loss_weight_mass", objective="main") == pytest.approx(mass, rel=1e-6)
        got = mon.value("loss_accumulation_exponent", objective="main")
        assert got == (None if exponent is None else pytest.approx(exponent, rel=1e-6, abs=1e-9))
        assert mon.value("microbatches") == len(micro)


def test_a_mixture_is_judged_per_objective():
    """Hard labels normalized, KD carrying tau^2 = 16 (declared) but not divided by the 2
    micro-batches: the hard term reads 1, the KD term 2 x 16 / 16 = 2 with exponent 1."""
    model, opt = model_and_opt()
    with attach(model, opt, run="mix", sink="null", every=1, modalities=("text",)) as mon:
        for k in range(2):
            ids, labels, mask = batch([6, 4, 5, 3], seed=k)
            logits = model(ids)
            hard = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
            soft = F.kl_div(
                F.log_softmax(logits / 4, -1), F.softmax(torch.zeros_like(logits), -1), reduction="none"
            ).sum(-1)
            mon.track_loss(hard, modality="text", mask=mask, objective="hard")
            mon.track_loss(soft, modality="text", mask=mask, objective="kd", weight=16.0)
            tokens = mask.sum()
            ((hard * mask).sum() / tokens / 2 + 16.0 * (soft * mask).sum() / tokens).backward()
        opt.step()
        assert mon.value("loss_weight_mass", objective="hard") == pytest.approx(1.0, rel=1e-6)
        assert mon.value("loss_accumulation_exponent", objective="hard") == pytest.approx(0.0, abs=1e-9)
        assert mon.value("loss_weight_mass", objective="kd") == pytest.approx(2.0, rel=1e-6)
        assert mon.value("loss_accumulation_exponent", objective="kd") == pytest.approx(1.0, rel=1e-6)
        assert mon.value("token_weight_spread_ratio", objective="hard") == pytest.approx(1.0)
        assert mon.value("microbatches") == 2


def _dilution_step(mon, model, opt, scheme: str, lengths: list[int], codes: list[int]):
    ids, labels, mask = batch(lengths)
    pt = per_token(model, ids, labels)
    mon.track_loss(pt, modality=torch.tensor(codes), mask=mask)
    n = mask.sum(1).double()
    per_sample = (pt * mask).sum(1) / mask.sum(1)
    if scheme == "token":
        loss = (pt * mask).sum() / mask.sum()
    elif scheme == "sqrt":
        loss = (per_sample * n.sqrt()).sum() / n.sqrt().sum()
    else:
        loss = per_sample.mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


# 21 text samples of 400 label tokens, 4 image answers of 2 (the short answers of docs/incidents.md, I1).
LENGTHS, CODES = [400] * 21 + [2] * 4, [0] * 21 + [1] * 4
SAMPLE_SHARE = 4 / 25


@pytest.mark.parametrize(
    ("scheme", "declared", "grad_share", "excess"),
    [
        # Deliberate sqrt, undeclared: share 4 sqrt2 / (21 sqrt400 + 4 sqrt2); the fitted
        # exponent 0.5 is taken as the intent: excess 1.
        ("sqrt", None, 4 * 2**0.5 / (21 * 20 + 4 * 2**0.5), 1.0),
        ("sqrt", "sqrt", 4 * 2**0.5 / (21 * 20 + 4 * 2**0.5), 1.0),
        # Per-token, undeclared (I1): share 8 / 8408; intent per sample: excess = dilution.
        ("token", None, 8 / 8408, SAMPLE_SHARE / (8 / 8408)),
        # Per-token declared: the intent, excess 1.
        ("token", "token", 8 / 8408, 1.0),
        # Declared per sample but per-token: excess = the dilution.
        ("token", "sample", 8 / 8408, SAMPLE_SHARE / (8 / 8408)),
        # Per sample, as declared or not: share = sample share, excess 1.
        ("sample", None, SAMPLE_SHARE, 1.0),
    ],
)
def test_excess_dilution_judges_the_measured_scheme_against_the_intended_one(scheme, declared, grad_share, excess):
    model, opt = model_and_opt()
    with attach(
        model, opt, run="norm", sink="null", every=1, modalities=("text", "image"), loss_normalization=declared
    ) as mon:
        _dilution_step(mon, model, opt, scheme, LENGTHS, CODES)
        assert mon.value("modality_grad_share_ratio", modality="image") == pytest.approx(grad_share, rel=1e-6)
        assert mon.value("modality_dilution_ratio", modality="image") == pytest.approx(
            SAMPLE_SHARE / grad_share, rel=1e-6
        )
        assert mon.value("modality_excess_dilution_ratio", modality="image") == pytest.approx(excess, rel=1e-6)


def test_sqrt_with_short_answers_dilutes_12x_with_an_exponent_of_one_half():
    model, opt = model_and_opt()
    with attach(model, opt, run="norm", sink="null", every=1, modalities=("text", "image")) as mon:
        _dilution_step(mon, model, opt, "sqrt", LENGTHS, CODES)
        assert mon.value("loss_norm_exponent") == pytest.approx(0.5, abs=1e-5)  # float32 weights
        assert 11 < mon.value("modality_dilution_ratio", modality="image") < 13


def test_declared_per_sample_weighting_reports_its_spread_as_the_intent():
    """One sample per micro-batch, each averaged over its own tokens: a mean of means by
    design. Undeclared, the spread is the token-count ratio 8 / 2 (MeanOfMeansLoss);
    declared per sample, the same ratio is the intent: reported labelled
    normalization="sample", which MeanOfMeansLoss does not judge."""
    for declared in (None, "sample"):
        model, opt = model_and_opt()
        with attach(
            model, opt, run="mom", sink="null", every=1, modalities=("text",), loss_normalization=declared
        ) as mon:
            for k, length in enumerate((8, 2)):
                ids, labels, mask = batch([length], seed=k)
                pt = per_token(model, ids, labels)
                mon.track_loss(pt, modality="text", mask=mask)
                ((pt * mask).sum() / mask.sum() / 2).backward()
            opt.step()
            plain = mon.value("token_weight_spread_ratio", objective="main")
            intended = mon.value("token_weight_spread_ratio", objective="main", normalization="sample")
            if declared is None:
                assert plain == pytest.approx(8 / 2, rel=1e-9) and intended is None
            else:
                assert intended == pytest.approx(8 / 2, rel=1e-9) and plain is None


def test_per_sample_spread_covers_micro_batches_of_several_samples():
    """GRPO's per-sequence mean: each micro-batch holds sequences of different lengths,
    each averaged over its own tokens. Declared per sample, the spread is the step's
    largest token weight over its smallest, read off the gradient here (no micro-batch
    is uniform, which the undeclared figure needs: there it is absent)."""
    for declared in (None, "sample"):
        model, opt = model_and_opt()
        grads: list[torch.Tensor] = []
        with attach(model, opt, run="grpo", sink="null", every=1, loss_normalization=declared) as mon:
            for k, lengths in enumerate(([8, 3], [5, 2, 6])):
                ids, labels, mask = batch(lengths, seed=k)
                pt = per_token(model, ids, labels)
                mon.track_loss(pt, mask=mask)
                pt.register_hook(lambda g, m=mask, out=grads: out.append(g[m].detach().clone()))
                per_seq = (pt * mask).sum(1) / mask.sum(1)
                (per_seq.mean() / 2).backward()
            opt.step()
            w = torch.cat(grads).double()
            truth = float(w.max() / w.min())
            assert truth == pytest.approx(18 / 6, rel=1e-6)  # by hand: 1 / (3 x 2 or 2 x 3) over 1 / (6 x 3)
            got = mon.value("token_weight_spread_ratio", objective="main", normalization="sample")
            if declared is None:
                assert got is None and mon.value("token_weight_spread_ratio", objective="main") is None
            else:
                assert got == pytest.approx(truth, rel=1e-5)


def test_a_per_token_map_classes_a_sample_by_any_of_its_positions(caplog):
    """A VLM batch whose per-token codes mark image *input* positions, while only text
    tokens are labels: a sample with image positions is an image sample (its label
    tokens are text); one without is text. A modality marking only positions of samples
    without label tokens is said to be absent: a log line and an event."""
    model, opt = model_and_opt()
    ids, labels, mask = batch([8, 8])
    mask[:, :4] = False  # the first 4 positions are the image (sample 0) or a prompt, not labels
    codes = torch.zeros(2, 8, dtype=torch.long)
    codes[0, :4] = 1
    with (
        caplog.at_level(logging.WARNING, logger="trainvitals"),
        attach(model, opt, run="vlm", sink="null", every=1, modalities=("text", "image")) as mon,
    ):
        pt = per_token(model, ids, labels)
        mon.track_loss(pt, modality=codes, mask=mask)
        ((pt * mask).sum() / mask.sum()).backward()
        opt.step()
        opt.zero_grad()
        assert mon.value("modality_sample_share_ratio", modality="image") == 0.5
        assert mon.value("modality_token_share_ratio", modality="image") == 0.5
        assert not [e for e in mon.latest_events() if e["kind"] in ("modality_without_label_tokens",)]
        assert not [e for e in mon.latest_events() if e["kind"] == "loss_sample_mixed_modality"]
        # Image positions only on a sample without label tokens: absent, and said so.
        no_labels = mask.clone()
        no_labels[0] = False
        for _ in range(2):  # the warning is read a step later (no host sync)
            pt = per_token(model, ids, labels)
            mon.track_loss(pt, modality=codes, mask=no_labels)
            ((pt * no_labels).sum() / no_labels.sum()).backward()
            opt.step()
            opt.zero_grad()
            assert mon.value("modality_sample_share_ratio", modality="image") == 0.0
            events = [e for e in mon.latest_events() if e["kind"] == "modality_without_label_tokens"]
            assert [e["labels"] for e in events] == [{"modality": "image"}]
    warnings = [r.getMessage() for r in caplog.records if "only of samples without label tokens" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"objective": "has space"}, "objective='has space' is not a usable name"),
        ({"weight": 0.0}, "weight=0.0 must be a positive number"),
        ({"weight": True}, "weight=True must be a positive number"),
        ({"normalization": "mean"}, "normalization='mean'; declare one of"),
    ],
)
def test_declarations_are_checked_at_once(kwargs, message):
    model, opt = model_and_opt()
    ids, labels, mask = batch([3, 3])
    with attach(model, opt, run="bad", sink="null", modalities=("text",)) as mon:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            mon.track_loss(per_token(model, ids, labels), modality="text", mask=mask, **kwargs)


def test_attach_checks_the_declared_normalization():
    model, opt = model_and_opt()
    with pytest.raises(ValueError, match="loss_normalization must be 'token', 'sqrt', 'sample' or None"):
        attach(model, opt, run="bad", sink="null", loss_normalization="per-token")
