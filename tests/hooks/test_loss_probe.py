"""The opt-in probe: per-modality parameter-space gradient norms and cosines equal
separate backward passes, and the user's own gradients are untouched."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.hooks._loss_models import MODALITIES, TokenModel, padded, per_token_loss, reduce_loss, samples
from trainvitals.hooks import attach

BATCHES = [padded(samples([40, 12, 33], [0, 1, 0], seed=70), 0), padded(samples([25, 9], [1, 1], seed=71), 3)]
TOTAL = sum(float(r.mask.sum()) for r in BATCHES)


def reduce(how: str):
    if how == "token":
        return lambda pt, rows: reduce_loss(pt, rows, "token", total_tokens=TOTAL)
    return lambda pt, rows: reduce_loss(pt, rows, "sample", n_samples=5)


def modality_grads(how: str) -> list[list[torch.Tensor]]:
    """Reference: one backward per modality of the step's loss restricted to that
    modality's label tokens (the other tokens' losses are held constant)."""
    model = TokenModel(0)
    out = []
    for m in range(len(MODALITIES)):
        model.zero_grad()
        for rows in BATCHES:
            pt, _ = per_token_loss(model, rows)
            keep = (rows.modality == m)[:, None] & rows.mask
            pt = torch.where(keep, pt, pt.detach())
            reduce(how)(pt, rows).backward()
        out.append([p.grad.clone() for p in model.parameters()])
    return out


def flat(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads]).double()


@pytest.mark.parametrize("how", ["token", "sample"])
@pytest.mark.parametrize("scaled", [False, True], ids=["fp32", "grad-scaler"])
def test_probe_norms_and_cosine_equal_separate_backward_passes(how, scaled, caplog):
    caplog.set_level(logging.WARNING, logger="trainvitals")
    ref = [flat(g) for g in modality_grads(how)]
    model = TokenModel(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaled else None
    mon = attach(model, opt, run="probe", sink="null", every=1, probe_every=1, modalities=MODALITIES, scaler=scaler)
    for rows in BATCHES:
        pt, logits = per_token_loss(model, rows)
        mon.track_loss(pt, modality=rows.modality, mask=rows.mask, output=logits)
        loss = reduce(how)(pt, rows)
        (scaler.scale(loss) if scaler else loss).backward()
    user_grads = flat([p.grad for p in model.parameters()]) / (scaler.get_scale() if scaler else 1.0)
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()

    for m, name in enumerate(MODALITIES):
        assert mon.value("modality_grad_norm", modality=name, scope="params") == pytest.approx(
            float(ref[m].norm()), rel=1e-5
        )
    cos = float(ref[0] @ ref[1] / (ref[0].norm() * ref[1].norm()))
    assert mon.value("modality_grad_cosine", modality="text", other="image") == pytest.approx(cos, rel=1e-4, abs=1e-6)
    assert mon.value("modality_grad_cosine", modality="image", other="text") == pytest.approx(cos, rel=1e-4, abs=1e-6)
    # The probe's extra backward passes leave the user's gradients as they were.
    assert user_grads == pytest.approx(ref[0] + ref[1], rel=1e-5, abs=1e-9)
    # The output-gradient norms were not disturbed by the probe's backward passes either.
    assert mon.value("loss_weight_mass", objective="main") == pytest.approx(1.0, rel=1e-6)
    mon.close()
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # nothing failed, nothing to warn


def test_probe_runs_only_on_probe_steps():
    model = TokenModel(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = attach(model, opt, run="probe", sink="null", every=1, probe_every=3, modalities=MODALITIES)
    seen = []
    for _ in range(6):
        for rows in BATCHES:
            pt, _ = per_token_loss(model, rows)
            mon.track_loss(pt, modality=rows.modality, mask=rows.mask)
            reduce("token")(pt, rows).backward()
        opt.step()
        opt.zero_grad()
        seen.append(mon.value("modality_grad_norm", modality="text", scope="params") is not None)
    assert seen == [True, False, True, False, False, True]  # step 1, then steps 3 and 6
    mon.close()


def test_without_probe_no_parameter_space_metrics():
    model = TokenModel(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with attach(model, opt, run="probe", sink="null", every=1, modalities=MODALITIES) as mon:
        rows = BATCHES[0]
        pt, _ = per_token_loss(model, rows)
        mon.track_loss(pt, modality=rows.modality, mask=rows.mask)
        reduce("token")(pt, rows).backward()
        opt.step()
        names = {s["name"] for s in mon.latest()}
        assert "modality_grad_cosine" not in names
        assert mon.value("modality_grad_norm", modality="text", scope="params") is None
