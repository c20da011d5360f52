"""Data parallel: two gloo ranks with different modality mixes report what one
process computes over the union (DDP averages gradients over ranks)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.hooks._loss_models import MODALITIES, TokenModel, dp_batches, per_token_loss, reduce_loss, reference
from tests.support import run_ranks as run_rank_processes

HERE = Path(__file__).resolve().parent
WORLD = 2
TIMEOUT_S = 180

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")]


def run_ranks(tmp_path: Path, probe: bool) -> list[dict]:
    return run_rank_processes(
        HERE / "_loss_models.py", tmp_path / "rank0.json", "1" if probe else "0", world=WORLD, timeout=TIMEOUT_S
    )


def value(samples: list[dict], name: str, **labels: str) -> float | None:
    for s in samples:
        if s["name"] == name and s["labels"] == labels:
            return s["value"]
    return None


def union_reference() -> tuple[dict, list[float], list[torch.Tensor], int]:
    """The same step in one process: L = (L_0 + L_1) / world, L_r normalized by rank r's tokens."""
    model = TokenModel(0)
    pts, losses, rows_all = [], [], []
    sq = [0.0, 0.0]
    for mine in dp_batches():
        own = sum(float(r.mask.sum()) for r in mine)
        for rows in mine:
            pt, logits = per_token_loss(model, rows)
            loss = reduce_loss(pt, rows, "token", total_tokens=own) / WORLD
            (g,) = torch.autograd.grad(loss, logits, retain_graph=True)
            per_sample = g.double().square().sum((1, 2))
            for m in range(2):
                sq[m] += float(per_sample[rows.modality == m].sum())
            pts.append(pt)
            losses.append(loss)
            rows_all.append(rows)
    ref = reference(pts, losses, rows_all)
    grads = []
    for m in range(2):
        model.zero_grad()
        for mine in dp_batches():
            own = sum(float(r.mask.sum()) for r in mine)
            for rows in mine:
                pt, _ = per_token_loss(model, rows)
                keep = (rows.modality == m)[:, None] & rows.mask
                (reduce_loss(torch.where(keep, pt, pt.detach()), rows, "token", total_tokens=own) / WORLD).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double())
    return ref, [math.sqrt(s) for s in sq], grads


def test_two_ranks_report_the_union_of_their_samples(tmp_path):
    got = run_ranks(tmp_path, probe=True)
    ref, out_norms, grads = union_reference()
    for key in ("sample_share", "token_share", "grad_share", "dilution"):
        values = [value(got, f"modality_{key}_ratio", modality=m) for m in MODALITIES]
        assert values == pytest.approx(ref[key], rel=1e-5), key
    assert value(got, "loss_weight_mass", objective="main") == pytest.approx(ref["mass"], rel=1e-5)
    assert ref["mass"] == pytest.approx(1.0)  # each rank normalized: DDP's mean keeps the mass at 1
    assert value(got, "loss_norm_exponent") == pytest.approx(ref["exponent"], abs=1e-4)
    # Each rank normalizes by its own tokens: the I3 pattern across ranks (940 vs 520 tokens).
    assert value(got, "token_weight_spread_ratio", objective="main") == pytest.approx(940 / 520, rel=1e-6)
    assert [value(got, "modality_grad_norm", modality=m, scope="output") for m in MODALITIES] == pytest.approx(
        out_norms, rel=1e-5
    )
    # The probe combines the ranks' parameter gradients (DDP's mean).
    assert [value(got, "modality_grad_norm", modality=m, scope="params") for m in MODALITIES] == pytest.approx(
        [float(g.norm()) for g in grads], rel=1e-5
    )
    cos = float(grads[0] @ grads[1] / (grads[0].norm() * grads[1].norm()))
    assert value(got, "modality_grad_cosine", modality="text", other="image") == pytest.approx(cos, rel=1e-4)
    assert value(got, "microbatches") == 2
    assert value(got, "nonfinite_total", what="loss") == 0
