"""A plain training loop run twice, once with ``track_loss`` and once with zero-code
accounting (``attach(loss_from_logits=True)``), on the tiny token model of the
loss-accounting tests. Run as a script, it is one rank of the data-parallel test."""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # a rank of the data-parallel test: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F

from tests.hooks._loss_models import (
    MODALITIES,
    VOCAB,
    Rows,
    TokenModel,
    packed,
    padded,
    reduce_loss,
    samples,
)
from trainvitals.hooks import attach

LOSS_METRICS = (
    "loss",
    "modality_loss",
    "modality_sample_share_ratio",
    "modality_token_share_ratio",
    "modality_grad_share_ratio",
    "modality_dilution_ratio",
    "modality_excess_dilution_ratio",
    "loss_weight_mass",
    "loss_accumulation_exponent",
    "loss_norm_exponent",
    "microbatches",
    "token_weight_spread_ratio",
    "modality_grad_norm",
    "nonfinite_total",
)


def micro_batches(accum: int, layout: str, seed: int = 0) -> list[Rows]:
    """``accum`` micro-batches of mixed text/image samples of different lengths, one
    sample per row (``padded``) or packed into rows of 64 tokens (``packed``)."""
    out = []
    first = 0
    for k in range(accum):
        lengths = [30 + 7 * k, 5, 18, 9 + 3 * k, 40][: 3 + k % 3]
        mods = [0, 1, 0, 1, 1][: len(lengths)]
        batch = samples(lengths, mods, seed=seed + k)
        out.append(padded(batch, first) if layout == "padded" else packed(batch, 64, first))
        first += len(batch)
    return out


def job_loss(per_token: torch.Tensor, rows: Rows, k: int, batches: list[Rows], scheme: str) -> torch.Tensor:
    """Micro-batch k's share of the step's loss under ``scheme``: "token", "sqrt",
    "sample" normalized over the whole step; "mean-of-means": each micro-batch's token
    mean divided by the micro-batch count; "undivided": the micro-batch mean alone."""
    total = sum(float(r.mask.sum()) for r in batches)
    n_samples = sum(int(r.sample[r.mask].unique().numel()) for r in batches)
    if scheme == "token":
        return reduce_loss(per_token, rows, "token", total_tokens=total)
    if scheme == "sample":
        return reduce_loss(per_token, rows, "sample", n_samples=n_samples)
    if scheme == "sqrt":
        denom = 0.0
        for r in batches:
            ids = r.sample[r.mask]
            denom += float(torch.unique(ids, return_counts=True)[1].double().sqrt().sum())
        ids = rows.sample[rows.mask]
        uniq, inv, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        sums = torch.zeros(len(uniq)).index_add(0, inv, per_token[rows.mask])
        return (sums / counts.sqrt()).sum() / denom
    if scheme == "mean-of-means":
        return reduce_loss(per_token, rows, "token") / len(batches)
    if scheme == "undivided":
        return reduce_loss(per_token, rows, "token")
    raise ValueError(scheme)


def run_job(zero_code: bool, scheme: str, steps: list[list[Rows]], model=None, **options) -> list[dict]:
    """Train over ``steps`` (each a list of micro-batches); the last report's samples."""
    model = model if model is not None else TokenModel(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    extra = {"loss_from_logits": True} if zero_code else {}
    mon = attach(model, opt, run="plain", sink="null", every=1, modalities=MODALITIES, **extra, **options)
    for batches in steps:
        for k, rows in enumerate(batches):
            if zero_code:
                mon.tag_batch(modality=rows.modality, segments=rows.segments)
            logits = model(rows.ids)
            per_token = F.cross_entropy(logits.reshape(-1, VOCAB), rows.labels.reshape(-1), reduction="none").view_as(
                rows.labels
            )
            if not zero_code:
                mon.track_loss(per_token, modality=rows.modality, mask=rows.mask, segments=rows.segments, output=logits)
            job_loss(per_token, rows, k, batches, scheme).backward()
        opt.step()
        opt.zero_grad()
    result = mon.latest()
    mon.close()
    return result


def loss_figures(samples_: list[dict]) -> dict[tuple, float]:
    return {(s["name"], tuple(sorted(s["labels"].items()))): s["value"] for s in samples_ if s["name"] in LOSS_METRICS}


# -- one rank of the data-parallel test ------------------------------------------
def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    import datetime
    import json
    import warnings

    import torch.distributed as dist
    from torch import nn

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    # Each rank its own micro-batches (different lengths and modality mixes).
    steps = [micro_batches(2, "padded", seed=10 * rank + s) for s in range(2)]
    results = {}
    for arm in ("track_loss", "zero_code"):
        ddp = nn.parallel.DistributedDataParallel(TokenModel(0))
        results[arm] = run_job(arm == "zero_code", "token", steps, model=ddp)
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
