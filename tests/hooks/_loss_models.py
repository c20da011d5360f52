"""Tiny models, batches and plain-torch references shared by the loss-accounting tests.

The model is an embedding followed by a linear head over a small vocabulary: each
token's loss depends on that token only, so 85k tokens are cheap and packing
samples into rows changes no loss. Run as a script, this file is one rank of the
data-parallel test (see test_loss_distributed.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM = 16, 8
MODALITIES = ("text", "image")


class TokenModel(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


@dataclass
class Sample:
    ids: torch.Tensor  # [n] input tokens
    labels: torch.Tensor  # [n] target tokens
    modality: int


def samples(lengths: list[int], modalities: list[int], seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    return [
        Sample(torch.randint(0, VOCAB, (n,), generator=g), torch.randint(0, VOCAB, (n,), generator=g), m)
        for n, m in zip(lengths, modalities, strict=True)
    ]


def i1_samples(seed: int = 0) -> list[Sample]:
    """docs/incidents.md I1: 84% text samples of 4000 label tokens, 16% image of 200 (21 + 4)."""
    return samples([4000] * 21 + [200] * 4, [0] * 21 + [1] * 4, seed)


@dataclass
class Rows:
    ids: torch.Tensor  # [B, T]
    labels: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] label tokens
    modality: torch.Tensor  # [B] per row, or [B, T] per token when packed
    sample: torch.Tensor  # [B, T] global sample index per token (-1: padding)
    segments: torch.Tensor | None  # [B, T] segment id per token when packed


def padded(batch: list[Sample], first: int = 0) -> Rows:
    """One sample per row, padded to the longest; ``first`` numbers the samples."""
    t = max(len(s.ids) for s in batch)
    b = len(batch)
    ids = torch.zeros(b, t, dtype=torch.long)
    labels = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.bool)
    sample = torch.full((b, t), -1, dtype=torch.long)
    for i, s in enumerate(batch):
        n = len(s.ids)
        ids[i, :n], labels[i, :n], mask[i, :n], sample[i, :n] = s.ids, s.labels, True, first + i
    modality = torch.tensor([s.modality for s in batch])
    return Rows(ids, labels, mask, modality, sample, None)


def packed(batch: list[Sample], row_len: int, first: int = 0) -> Rows:
    """Samples packed greedily into rows of ``row_len`` tokens, with segment ids
    (1, 2, ... within a row; padding 0) and per-token modality codes."""
    rows: list[list[int]] = [[]]
    used = [0]
    for i, s in enumerate(batch):
        if used[-1] + len(s.ids) > row_len:
            rows.append([])
            used.append(0)
        rows[-1].append(i)
        used[-1] += len(s.ids)
    b = len(rows)
    ids = torch.zeros(b, row_len, dtype=torch.long)
    labels = torch.zeros(b, row_len, dtype=torch.long)
    mask = torch.zeros(b, row_len, dtype=torch.bool)
    sample = torch.full((b, row_len), -1, dtype=torch.long)
    segments = torch.zeros(b, row_len, dtype=torch.long)
    modality = torch.full((b, row_len), -7, dtype=torch.long)  # padding: a code nobody reads
    for r, members in enumerate(rows):
        at = 0
        for k, i in enumerate(members):
            s = batch[i]
            n = len(s.ids)
            sl = slice(at, at + n)
            ids[r, sl], labels[r, sl], mask[r, sl] = s.ids, s.labels, True
            sample[r, sl], segments[r, sl], modality[r, sl] = first + i, k + 1, s.modality
            at += n
    return Rows(ids, labels, mask, modality, sample, segments)


def per_token_loss(model: nn.Module, rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(rows.ids)
    per_token = F.cross_entropy(logits.reshape(-1, VOCAB), rows.labels.reshape(-1), reduction="none")
    return per_token.view_as(rows.labels), logits


def masked_steps(mon, model: nn.Module, opt: torch.optim.Optimizer, rows: Rows, steps: int) -> None:
    """``steps`` optimizer steps on ``rows``' summed label-token losses, each micro-batch
    tracked with its output gradient; each report must materialize (``mon.latest()``)."""
    for _ in range(steps):
        per_token, logits = per_token_loss(model, rows)
        mon.track_loss(per_token, modality=rows.modality, mask=rows.mask, output=logits)
        torch.where(rows.mask, per_token, 0.0).sum().backward()
        opt.step()
        opt.zero_grad()
        assert mon.latest(), "every report materializes"


def reduce_loss(
    per_token: torch.Tensor, rows: Rows, scheme: str, total_tokens: float | None = None, n_samples: int | None = None
) -> torch.Tensor:
    """The job's reduction of its per-token losses (I1's three normalizations).

    "token": sum over label tokens / total label tokens; "sqrt": each sample's mean
    times sqrt(n_s), over the sum of sqrt(n_s) (Qwen3-VL); "sample": mean of the
    sample means. ``total_tokens``/``n_samples`` default to this batch's."""
    pt = torch.where(rows.mask, per_token, 0.0)
    if scheme == "token":
        return pt.sum() / (total_tokens if total_tokens is not None else rows.mask.sum())
    ids = rows.sample[rows.mask]
    uniq, inv = torch.unique(ids, return_inverse=True)
    sums = torch.zeros(len(uniq)).index_add(0, inv, per_token[rows.mask])
    n = torch.zeros(len(uniq)).index_add(0, inv, torch.ones_like(inv, dtype=torch.float))
    if scheme == "sqrt":
        return (sums / n.sqrt()).sum() / n.sqrt().sum()
    if scheme == "sample":
        return (sums / n).sum() / (n_samples if n_samples is not None else len(uniq))
    raise ValueError(scheme)


def reference(
    per_tokens: list[torch.Tensor], losses: list[torch.Tensor], rows: list[Rows], modalities: int = 2
) -> dict[str, list[float] | float]:
    """Plain-torch reference: w = dL/dl from autograd.grad, then the definitions
    of loss_report.py computed one sample at a time."""
    per_sample: dict[int, list[float]] = {}  # id -> [modality, n, w]
    for pt, loss, r in zip(per_tokens, losses, rows, strict=True):
        (w,) = torch.autograd.grad(loss, pt, retain_graph=True)
        for sid in r.sample[r.mask].unique().tolist():
            sel = (r.sample == sid) & r.mask
            mod = r.modality[sel][0] if r.modality.dim() == 2 else r.modality[sel.any(1)][0]
            per_sample[sid] = [int(mod), float(sel.sum()), float(w[sel].double().sum())]
    n_by = [0.0] * modalities
    s_by = [0.0] * modalities
    w_by = [0.0] * modalities
    for mod, n, w in per_sample.values():
        n_by[mod] += n
        s_by[mod] += 1
        w_by[mod] += w
    xs = [math.log(n) for _, n, _ in per_sample.values()]
    ys = [math.log(w) for _, _, w in per_sample.values()]
    k = len(xs)
    mx, my = sum(xs) / k, sum(ys) / k
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx > 1e-12 else float("nan")
    sample_share = [s / sum(s_by) for s in s_by]
    grad_share = [w / sum(w_by) for w in w_by]
    return {
        "sample_share": sample_share,
        "token_share": [n / sum(n_by) for n in n_by],
        "grad_share": grad_share,
        "dilution": [a / b for a, b in zip(sample_share, grad_share, strict=True)],
        "mass": sum(w_by),
        "exponent": slope,
    }


# -- one rank of the data-parallel test ----------------------------------------
def _rank_main(rank: int, world: int, port: int, out: str, probe: bool) -> None:
    import datetime
    import json
    import warnings

    import torch.distributed as dist

    from trainvitals.hooks import attach

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    batches = dp_batches()
    model = TokenModel(0)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
    extra = {"probe_every": 1} if probe else {}
    mon = attach(ddp, opt, run="dp", sink="null", every=1, modalities=MODALITIES, **extra)
    mine = batches[rank]
    for rows in mine:
        per_token, logits = per_token_loss(ddp, rows)
        mon.track_loss(per_token, modality=rows.modality, mask=rows.mask, output=logits)
        # Each rank normalizes by its own token count (DDP then averages over ranks).
        own = sum(float(r.mask.sum()) for r in mine)
        reduce_loss(per_token, rows, "token", total_tokens=own).backward()
    opt.step()
    result = mon.latest()
    mon.close()
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(result, fh)
    dist.barrier()
    dist.destroy_process_group()


def dp_batches() -> list[list[Rows]]:
    """Two ranks with different modality mixes, two micro-batches each."""
    r0 = samples([300, 280, 320, 40], [0, 0, 0, 1], seed=1)
    r1 = samples([60, 50, 310, 45, 55], [1, 1, 0, 1, 1], seed=2)
    return [[padded(r0[:2], 0), padded(r0[2:], 2)], [padded(r1[:3], 10), padded(r1[3:], 13)]]


if __name__ == "__main__":
    import sys

    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5] == "1")
