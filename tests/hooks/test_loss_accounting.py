"""Loss accounting (docs/incidents.md I1, I2, I3) against the write-up's numbers and
plain-torch references on a tiny CPU model, each with its healthy twin."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from tests.hooks._loss_models import (
    MODALITIES,
    Rows,
    TokenModel,
    i1_samples,
    packed,
    padded,
    per_token_loss,
    reduce_loss,
    reference,
    samples,
)
from trainvitals.hooks import attach

pytestmark = pytest.mark.usefixtures("one_torch_thread", "loss_emission")  # tests/conftest.py

LOSS_METRICS = (
    "modality_sample_share_ratio",
    "modality_token_share_ratio",
    "modality_grad_share_ratio",
    "modality_dilution_ratio",
    "loss_weight_mass",
    "loss_norm_exponent",
    "microbatches",
    "token_weight_spread_ratio",
    "loss",
    "modality_grad_norm",
)


def monitored(every: int = 1, **options):
    model = TokenModel(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = attach(model, opt, run="loss", sink="null", every=every, modalities=MODALITIES, **options)
    return model, opt, mon


def train_step(model, opt, mon, batches: list[Rows], reduce, *, output: bool = True, scaler=None) -> None:
    """One optimizer step over ``batches`` (micro-batches); ``reduce(per_token, rows, k)``
    is the job's loss for micro-batch k."""
    for k, rows in enumerate(batches):
        per_token, logits = per_token_loss(model, rows)
        mon.track_loss(
            per_token, modality=rows.modality, mask=rows.mask, segments=rows.segments, output=logits if output else None
        )
        loss = reduce(per_token, rows, k)
        (scaler.scale(loss) if scaler is not None else loss).backward()
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad()


def by_modality(mon, name: str, **labels: str) -> list[float | None]:
    return [mon.value(name, modality=m, **labels) for m in MODALITIES]


def loss_samples(mon) -> dict[tuple[str, tuple], float]:
    return {
        (s["name"], tuple(sorted(s["labels"].items()))): s["value"] for s in mon.latest() if s["name"] in LOSS_METRICS
    }


# -- I1: the write-up's numbers -------------------------------------------------
I1_SCHEMES = {
    # scheme: (image grad share, image dilution, fitted exponent), from docs/incidents.md I1
    "per-token": ("token", 0.16 * 200 / (0.84 * 4000 + 0.16 * 200), 1.0),
    "sqrt": ("sqrt", 0.16 * math.sqrt(200) / (0.84 * math.sqrt(4000) + 0.16 * math.sqrt(200)), 0.5),
    "per-sample": ("sample", 0.16, 0.0),
}


@pytest.mark.parametrize("scheme", list(I1_SCHEMES))
def test_i1_grad_shares_reproduce_the_writeup(scheme):
    how, share, exponent = I1_SCHEMES[scheme]
    model, opt, mon = monitored()
    rows = padded(i1_samples())
    train_step(model, opt, mon, [rows], lambda pt, r, k: reduce_loss(pt, r, how))

    assert by_modality(mon, "modality_sample_share_ratio") == pytest.approx([0.84, 0.16], rel=1e-6)
    assert by_modality(mon, "modality_token_share_ratio") == pytest.approx([84000 / 84800, 800 / 84800], rel=1e-6)
    text_share, image_share = by_modality(mon, "modality_grad_share_ratio")
    assert image_share == pytest.approx(share, rel=1e-5)
    assert text_share == pytest.approx(1 - share, rel=1e-5)
    assert mon.value("modality_dilution_ratio", modality="image") == pytest.approx(0.16 / share, rel=1e-5)
    assert mon.value("loss_norm_exponent") == pytest.approx(exponent, abs=0.05)
    assert mon.value("loss_weight_mass", objective="main") == pytest.approx(1.0, rel=1e-5)
    assert mon.value("microbatches") == 1
    mon.close()
    # The write-up's rounded figures.
    assert round(image_share * 100, 3 if how == "token" else 2) == {"token": 0.943, "sqrt": 4.09, "sample": 16.0}[how]
    if how == "token":
        assert round(0.16 / image_share, 2) == 16.96
    if how == "sample":
        assert mon.value("modality_dilution_ratio", modality="image") == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("scheme", list(I1_SCHEMES))
def test_i1_statistics_equal_a_plain_torch_reference(scheme):
    how = I1_SCHEMES[scheme][0]
    model, opt, mon = monitored()
    batches = [padded(i1_samples()[:12], 0), padded(i1_samples()[12:], 12)]
    total = sum(float(r.mask.sum()) for r in batches)

    def reduce(pt, rows, k):
        # The same normalization over the whole step: one global denominator.
        if how == "token":
            return reduce_loss(pt, rows, "token", total_tokens=total)
        return reduce_loss(pt, rows, how, n_samples=25) if how == "sample" else _sqrt_global(pt, rows, batches)

    # Reference first, on its own forward: autograd.grad(L, per_token) = w.
    pts, losses = [], []
    for k, rows in enumerate(batches):
        pt, _ = per_token_loss(model, rows)
        pts.append(pt)
        losses.append(reduce(pt, rows, k))
    ref = reference(pts, losses, batches)
    train_step(model, opt, mon, batches, reduce)

    for key in ("sample_share", "token_share", "grad_share", "dilution"):
        got = by_modality(mon, f"modality_{key}_ratio")
        assert got == pytest.approx(ref[key], rel=1e-5), key
    assert mon.value("loss_weight_mass", objective="main") == pytest.approx(ref["mass"], rel=1e-5)
    assert mon.value("loss_norm_exponent") == pytest.approx(ref["exponent"], abs=1e-4)
    assert mon.value("microbatches") == 2
    mon.close()


def _sqrt_global(pt, rows, batches):
    """sqrt normalization with the denominator taken over the whole step."""
    denom = sum(float(r.mask.sum(1)[r.mask.any(1)].sqrt().sum()) for r in batches)
    per_sample = torch.where(rows.mask, pt, 0.0).sum(1) / rows.mask.sum(1).clamp_min(1).sqrt()
    return per_sample.sum() / denom


def test_loss_per_modality_is_the_mean_label_token_loss():
    model, opt, mon = monitored()
    rows = padded(samples([50, 70, 20, 30], [0, 0, 1, 1], seed=3))
    with torch.no_grad():
        ref_pt, _ = per_token_loss(model, rows)
    train_step(model, opt, mon, [rows], lambda pt, r, k: reduce_loss(pt, r, "token"))
    lab = rows.mask
    is_image = (rows.modality == 1)[:, None] & lab
    is_text = (rows.modality == 0)[:, None] & lab
    assert mon.value("modality_loss", modality="text") == pytest.approx(float(ref_pt[is_text].mean()), rel=1e-6)
    assert mon.value("modality_loss", modality="image") == pytest.approx(float(ref_pt[is_image].mean()), rel=1e-6)
    assert mon.value("loss") == pytest.approx(float(ref_pt[lab].mean()), rel=1e-6)
    mon.close()


@pytest.mark.parametrize("how", ["token", "sample"])
def test_output_grad_norm_per_modality_equals_reference(how):
    model, opt, mon = monitored()
    batches = [padded(samples([40, 9, 33], [0, 1, 0], seed=4), 0), padded(samples([12, 25], [1, 1], seed=5), 3)]
    total = sum(float(r.mask.sum()) for r in batches)

    def reduce(pt, rows, k):
        return (
            reduce_loss(pt, rows, "token", total_tokens=total)
            if how == "token"
            else reduce_loss(pt, rows, "sample", n_samples=5)
        )

    sq = [0.0, 0.0]
    for k, rows in enumerate(batches):
        pt, logits = per_token_loss(model, rows)
        (g,) = torch.autograd.grad(reduce(pt, rows, k), logits)
        per_sample = g.double().square().sum((1, 2))  # one sample per row
        for m in range(2):
            sq[m] += float(per_sample[rows.modality == m].sum())
    train_step(model, opt, mon, batches, reduce)
    got = by_modality(mon, "modality_grad_norm", scope="output")
    assert got == pytest.approx([math.sqrt(s) for s in sq], rel=1e-5)
    mon.close()


# -- I2: loss not divided by the accumulation steps -------------------------------
@pytest.mark.parametrize(("divide", "mass"), [(False, 4.0), (True, 1.0)], ids=["missing-division", "healthy"])
def test_weight_mass_shows_a_missing_accumulation_division(divide, mass, caplog):
    caplog.set_level(logging.WARNING, logger="trainvitals")
    model, opt, mon = monitored()
    batches = [padded(samples([30, 30], [0, 1], seed=10 + k), 2 * k) for k in range(4)]

    def reduce(pt, rows, k):
        loss = reduce_loss(pt, rows, "token")  # the micro-batch mean (DAPO's compute_loss)
        return loss / 4 if divide else loss

    train_step(model, opt, mon, batches, reduce)
    assert mon.value("loss_weight_mass", objective="main") == pytest.approx(mass, rel=1e-6)
    assert mon.value("microbatches") == 4
    assert mon.value("token_weight_spread_ratio", objective="main") == pytest.approx(1.0)  # equal token counts
    mon.close()
    assert not caplog.records, [r.getMessage() for r in caplog.records]


# -- I3: mean of per-micro-batch means --------------------------------------------
def test_mean_of_means_spread_equals_the_token_count_ratio():
    model, opt, mon = monitored()
    big = padded(samples([300, 300], [0, 0], seed=20), 0)  # 600 label tokens
    small = padded(samples([100, 50], [0, 1], seed=21), 2)  # 150 label tokens
    train_step(model, opt, mon, [big, small], lambda pt, r, k: reduce_loss(pt, r, "token") / 2)
    assert mon.value("token_weight_spread_ratio", objective="main") == pytest.approx(600 / 150, rel=1e-6)
    assert mon.value("loss_weight_mass", objective="main") == pytest.approx(1.0, rel=1e-6)
    mon.close()


def test_globally_normalized_per_token_loss_has_spread_one_and_mass_one():
    model, opt, mon = monitored()
    big = padded(samples([300, 300], [0, 0], seed=20), 0)
    small = padded(samples([100, 50], [0, 1], seed=21), 2)
    train_step(model, opt, mon, [big, small], lambda pt, r, k: reduce_loss(pt, r, "token", total_tokens=750))
    assert mon.value("token_weight_spread_ratio", objective="main") == pytest.approx(1.0, rel=1e-6)
    assert mon.value("loss_weight_mass", objective="main") == pytest.approx(1.0, rel=1e-6)
    mon.close()


def test_healthy_per_sample_loss_dilution_one_and_no_spread():
    model, opt, mon = monitored()
    rows = padded(samples([400, 380, 20, 25], [0, 0, 1, 1], seed=22))
    train_step(model, opt, mon, [rows], lambda pt, r, k: reduce_loss(pt, r, "sample"))
    assert by_modality(mon, "modality_dilution_ratio") == pytest.approx([1.0, 1.0], rel=1e-6)
    assert mon.value("token_weight_spread_ratio", objective="main") is None  # token weights not uniform: absent
    assert mon.value("loss_norm_exponent") == pytest.approx(0.0, abs=1e-6)
    mon.close()


def test_exponent_is_absent_when_every_sample_has_the_same_length():
    model, opt, mon = monitored()
    rows = padded(samples([64, 64, 64], [0, 1, 0], seed=23))
    train_step(model, opt, mon, [rows], lambda pt, r, k: reduce_loss(pt, r, "token"))
    assert mon.value("loss_norm_exponent") is None
    assert mon.value("modality_grad_share_ratio", modality="image") == pytest.approx(1 / 3, rel=1e-6)
    mon.close()


# -- sample definition: packed rows ------------------------------------------------
@pytest.mark.parametrize("layout", ["packed-2d", "packed-flat"])
def test_packed_rows_give_the_same_statistics_as_unpacked(layout):
    batch = samples([120, 30, 90, 15, 60, 25, 40], [0, 1, 0, 1, 0, 1, 1], seed=30)
    results = []
    for kind in ("padded", layout):
        model, opt, mon = monitored()
        rows = padded(batch) if kind == "padded" else packed(batch, row_len=160)
        if kind == "packed-flat":  # a 1-D per_token [N] with segments: one packed row
            rows = _flatten(rows)
        train_step(model, opt, mon, [rows], lambda pt, r, k: reduce_loss(pt, r, "sqrt"))
        results.append({k: v for k, v in loss_samples(mon).items()})
        mon.close()
    unpacked, packed_ = results
    assert packed_.keys() == unpacked.keys()
    for key, v in unpacked.items():
        assert packed_[key] == pytest.approx(v, rel=1e-5), key


def _flatten(rows: Rows) -> Rows:
    """The packed rows as one flat row of N tokens (per_token [N]); segment ids are
    offset per former row so they stay distinct."""
    seg = rows.segments + 100 * torch.arange(rows.segments.shape[0])[:, None]
    return Rows(
        rows.ids.reshape(-1),
        rows.labels.reshape(-1),
        rows.mask.reshape(-1),
        rows.modality.reshape(-1),
        rows.sample.reshape(-1),
        seg.reshape(-1),
    )


def test_flat_per_token_is_one_sample_per_element_without_segments():
    _model, opt, mon = monitored()
    per_token = torch.rand(6, requires_grad=True)
    mon.track_loss(per_token, modality=torch.tensor([0, 0, 0, 0, 1, 1]))
    (per_token * torch.tensor([1, 1, 1, 1, 2, 2.0])).sum().backward()
    opt.step()
    assert by_modality(mon, "modality_sample_share_ratio") == pytest.approx([4 / 6, 2 / 6])
    assert by_modality(mon, "modality_grad_share_ratio") == pytest.approx([0.5, 0.5])
    assert mon.value("loss_weight_mass", objective="main") == pytest.approx(8.0)
    mon.close()


# -- GradScaler ----------------------------------------------------------------------
@pytest.mark.parametrize("enabled", [True, False], ids=["scaling", "scaler-disabled"])
def test_grad_scaler_weights_are_unscaled_without_a_host_sync(enabled):
    batches = [padded(samples([80, 20, 60], [0, 1, 0], seed=40), 0), padded(samples([30, 10], [1, 1], seed=41), 3)]
    results = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=2.0**12, enabled=enabled)):
        model, opt, mon = monitored(scaler=scaler)
        train_step(model, opt, mon, batches, lambda pt, r, k: reduce_loss(pt, r, "sqrt") / 2, scaler=scaler)
        results.append(loss_samples(mon))
        mon.close()
    plain, scaled = results
    assert scaled.keys() == plain.keys()
    for key, v in plain.items():
        assert scaled[key] == pytest.approx(v, rel=1e-6), key


def test_a_step_the_scaler_skips_is_not_merged_into_the_next():
    model, opt, mon = monitored(scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    scaler = mon.scaler
    batches = [padded(samples([40, 20], [0, 1], seed=42 + k), 2 * k) for k in range(2)]
    reduce = lambda pt, r, k: reduce_loss(pt, r, "token") / 2  # noqa: E731
    train_step(model, opt, mon, batches, reduce, scaler=scaler)
    assert mon.step == 1
    handle = model.head.bias.register_hook(lambda g: g * float("inf"))  # overflow: the scaler skips
    train_step(model, opt, mon, batches, reduce, scaler=scaler)
    handle.remove()
    assert mon.step == 1
    train_step(model, opt, mon, batches, reduce, scaler=scaler)
    assert mon.step == 2
    assert mon.value("microbatches") == 2
    assert mon.value("loss_weight_mass", objective="main") == pytest.approx(1.0, rel=1e-6)
    mon.close()


# -- declared sum reduction -----------------------------------------------------------
@pytest.mark.parametrize(("scale", "mass"), [(None, 1.0), (1000.0, 0.25)], ids=["token-count", "declared-scale"])
def test_sum_reduction_reports_mass_relative_to_the_declared_scale(scale, mass):
    model, opt, mon = monitored(loss_reduction="sum", loss_scale=scale)
    batches = [padded(samples([100, 50], [0, 1], seed=50), 0), padded(samples([60, 40], [0, 1], seed=51), 2)]
    train_step(model, opt, mon, batches, lambda pt, r, k: torch.where(r.mask, pt, 0.0).sum())  # 250 tokens
    assert mon.value("loss_weight_mass", objective="main") == pytest.approx(mass, rel=1e-6)
    assert mon.value("token_weight_spread_ratio", objective="main") == pytest.approx(1.0)
    mon.close()


# -- modality given several ways -------------------------------------------------------
@pytest.mark.parametrize("form", ["codes", "names", "per-token-codes"])
def test_modality_as_codes_names_or_per_token(form):
    model, opt, mon = monitored()
    rows = padded(samples([30, 10, 20], [0, 1, 0], seed=60))
    modality = {
        "codes": rows.modality,
        "names": ["text", "image", "text"],
        "per-token-codes": rows.modality[:, None].expand_as(rows.mask).clone(),
    }[form]
    per_token, _ = per_token_loss(model, rows)
    mon.track_loss(per_token, modality=modality, mask=rows.mask)
    reduce_loss(per_token, rows, "token").backward()
    opt.step()
    assert by_modality(mon, "modality_grad_share_ratio") == pytest.approx([50 / 60, 10 / 60], rel=1e-6)
    mon.close()


def test_one_name_for_the_whole_micro_batch():
    model, opt, mon = monitored()
    rows = padded(samples([30, 10], [1, 1], seed=61))
    per_token, _ = per_token_loss(model, rows)
    mon.track_loss(per_token, modality="image", mask=rows.mask)
    reduce_loss(per_token, rows, "token").backward()
    opt.step()
    assert by_modality(mon, "modality_sample_share_ratio") == [0.0, 1.0]
    assert mon.value("modality_dilution_ratio", modality="text") is None  # no text sample: absent
    mon.close()


# -- value problems: events and one log line, never raised ------------------------------
def test_a_sample_mixing_modalities_is_an_event_and_a_log_line(caplog):
    model, opt, mon = monitored()
    rows = padded(samples([30, 10], [0, 1], seed=62))
    codes = rows.modality[:, None].expand_as(rows.mask).clone()
    codes[0, 5] = 1  # sample 0 mixes text and image label tokens
    with caplog.at_level(logging.WARNING, logger="trainvitals"):
        for _ in range(2):
            per_token, _ = per_token_loss(model, rows)
            mon.track_loss(per_token, modality=codes, mask=rows.mask)
            reduce_loss(per_token, rows, "token").backward()
            opt.step()
            if mon.step == 1:
                assert "loss_sample_mixed_modality" in [e["kind"] for e in mon.latest_events()]
    assert sum("mix modalities" in r.getMessage() for r in caplog.records) == 1
    # It counts under the highest code among its label tokens.
    assert by_modality(mon, "modality_sample_share_ratio") == [0.0, 1.0]
    mon.close()


def test_unknown_modality_codes_are_an_event_not_an_error(caplog):
    model, opt, mon = monitored()
    rows = padded(samples([30, 10, 20], [0, 1, 5], seed=63))
    with caplog.at_level(logging.WARNING, logger="trainvitals"):
        for _ in range(2):
            per_token, _ = per_token_loss(model, rows)
            mon.track_loss(per_token, modality=rows.modality, mask=rows.mask)
            reduce_loss(per_token, rows, "token").backward()
            opt.step()
    assert "loss_unknown_modality_code" in [e["kind"] for e in mon.latest_events()]
    assert any("outside" in r.getMessage() for r in caplog.records)
    # Totals include the unknown sample: shares of the known ones do not add up to 1.
    assert by_modality(mon, "modality_sample_share_ratio") == pytest.approx([1 / 3, 1 / 3])
    assert mon.value("loss_weight_mass", objective="main") == pytest.approx(1.0, rel=1e-6)
    mon.close()


def test_nonfinite_losses_are_counted_every_step_not_only_on_reports():
    model, opt, mon = monitored(every=4)
    rows = padded(samples([30, 10], [0, 1], seed=64))
    for step in range(1, 5):
        for k in range(2):
            per_token, _ = per_token_loss(model, rows)
            if step in (2, 3) and k == 0:
                per_token = per_token + torch.zeros_like(per_token).index_put(
                    (torch.tensor([0]), torch.tensor([3])), torch.tensor(float("nan"))
                )
            if step == 3 and k == 1:  # non-finite on a padding token: not a label, not counted
                per_token = per_token + torch.zeros_like(per_token).index_put(
                    (torch.tensor([1]), torch.tensor([20])), torch.tensor(float("inf"))
                )
            mon.track_loss(per_token, modality=rows.modality, mask=rows.mask)
            reduce_loss(torch.nan_to_num(per_token), rows, "token").backward()
        opt.step()
        opt.zero_grad()
    assert mon.step == 4
    assert mon.value("nonfinite_total", what="loss") == 2.0
    mon.close()


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("output", [False, True])
def test_a_nonfinite_token_stays_in_its_own_modality(layout, output):
    """An image token with an infinite weight and another with a NaN loss: the text
    figures stay what they are (its loss the plain mean, its grad share finite / inf =
    0, its dilution inf), the image ones and the totals carry the inf or NaN, and the
    exponent fit, whose lengths do vary, reads NaN rather than absent. A one-hot product
    would spread inf * 0 = NaN over every modality."""
    model, opt, mon = monitored()
    batch = samples([30, 10, 12, 7], [0, 1, 0, 1], seed=3)
    rows = padded(batch) if layout == "padded" else packed(batch, 40)
    image_tokens = (rows.modality == 1 if rows.modality.dim() == 2 else rows.modality[:, None] == 1) & rows.mask
    hit = image_tokens.nonzero()
    per_token, logits = per_token_loss(model, rows)
    nan_at = torch.zeros_like(per_token).index_put(tuple(hit[0]), torch.tensor(float("nan")))
    per_token = per_token + nan_at
    mon.track_loss(
        per_token, modality=rows.modality, mask=rows.mask, segments=rows.segments, output=logits if output else None
    )
    weights = rows.mask.float() / rows.mask.sum()
    weights = weights.index_put(tuple(hit[1]), torch.tensor(float("inf")))
    torch.autograd.backward(per_token, weights)
    opt.step()
    opt.zero_grad()
    text_tokens = rows.mask & ~image_tokens
    assert mon.value("modality_loss", modality="text") == pytest.approx(per_token[text_tokens].mean().item(), rel=1e-5)
    assert math.isnan(mon.value("modality_loss", modality="image"))
    assert math.isnan(mon.value("loss"))
    assert mon.value("modality_grad_share_ratio", modality="text") == 0.0
    assert math.isnan(mon.value("modality_grad_share_ratio", modality="image"))  # inf / inf
    assert mon.value("modality_dilution_ratio", modality="text") == float("inf")
    assert mon.value("modality_sample_share_ratio", modality="text") == pytest.approx(0.5)
    assert math.isnan(mon.value("loss_norm_exponent"))
    assert mon.value("loss_weight_mass", objective="main") == float("inf")
    assert mon.value("token_weight_spread_ratio", objective="main") is None  # the largest weight is not finite
    if output:
        assert math.isfinite(mon.value("modality_grad_norm", modality="text", scope="output"))
    mon.close()


def test_steps_that_are_not_reported_place_no_hooks():
    model, opt, mon = monitored(every=3)
    rows = padded(samples([30, 10], [0, 1], seed=65))
    hooked = []
    for _ in range(3):
        per_token, logits = per_token_loss(model, rows)
        mon.track_loss(per_token, modality=rows.modality, mask=rows.mask, output=logits)
        hooked.append((bool(per_token._backward_hooks), bool(logits._backward_hooks)))
        reduce_loss(per_token, rows, "token").backward()
        opt.step()
    assert hooked == [(True, True), (False, False), (True, True)]  # steps 1 and 3 are reported
    assert mon.value("microbatches") == 1
    mon.close()


def test_a_tracked_loss_that_gets_no_gradient_is_logged(caplog):
    model, opt, mon = monitored()
    rows = padded(samples([30, 10], [0, 1], seed=66))
    per_token, _ = per_token_loss(model, rows)
    mon.track_loss(per_token.clone(), modality=rows.modality, mask=rows.mask)  # not what backward goes through
    with caplog.at_level(logging.WARNING, logger="trainvitals"):
        reduce_loss(per_token, rows, "token").backward()
        opt.step()
    assert any("received no gradient" in r.getMessage() for r in caplog.records)
    assert mon.value("loss_weight_mass", objective="main") is None
    assert mon.value("modality_sample_share_ratio", modality="text") == 0.5
    mon.close()


# -- kept buffers ----------------------------------------------------------------
def test_step_buffers_alternate_so_a_step_awaiting_its_report_keeps_its_sums():
    from trainvitals.hooks.signals.loss.arguments import MAX_OBJECTIVES
    from trainvitals.hooks.signals.loss.binning import SumsLayout
    from trainvitals.hooks.signals.loss.step import LossStep, StepBuffers

    layout = SumsLayout(len(MODALITIES), MAX_OBJECTIVES)
    buffers = StepBuffers(layout)
    first, second, third = (LossStep(token=(i, None), reporting=True, probe=False) for i in range(3))
    buffers.take(first, torch.device("cpu"))
    first.sums.add_(1.0)
    first.extremes.fill_(2.0)
    buffers.take(second, torch.device("cpu"))  # the next step starts while the first awaits its report
    assert bool(first.sums.eq(1.0).all()) and bool(first.extremes.eq(2.0).all())
    assert bool(second.sums.eq(0.0).all()) and bool(second.extremes.eq(-math.inf).all())
    assert first.output.data_ptr() == first.sums[layout.output].data_ptr()
    assert first.counter.data_ptr() == first.sums[layout.nonfinite].data_ptr()
    buffers.take(third, torch.device("cpu"))  # two steps on: the first's buffer, reset
    assert third.sums.data_ptr() == first.sums.data_ptr() and bool(third.sums.eq(0.0).all())
