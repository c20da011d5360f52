"""FSDP2 x tensor parallelism on a 2-D DTensor mesh, four gloo ranks on the CPU, and the
rank worker of its tests (``python _fsdp_tp_models.py RANK WORLD PORT OUT MODE [STEPS]``;
under ``torch.distributed.run``: ``env env env OUT MODE [STEPS]``).

The tiny decoder of ``_tp_models`` on ``init_device_mesh("cpu", (2, 2), ("dp", "tp"))``:
q/k/v and up column-wise, o and down row-wise on ``mesh["tp"]`` (``parallelize_module``),
then ``fully_shard`` per block and on the root over ``mesh["dp"]``. The split matrices
become 2-D DTensors (``(_StridedShard, Shard)``, ``(Shard, Shard)``), the embedding, the
norms, the head and the ``[1]`` gain 1-D DTensors ``(Shard(0),)`` on the ``dp`` slice, a
copy on each ``tp`` rank. Each data-parallel rank gets its own batches, the two ``tp``
ranks of a data-parallel rank the same.

The batches are I1's: 25 samples per data-parallel rank and step, 4 of them (16%) image
samples whose answer is one token against the text samples' 20. ``MODE``:

- ``token``: ``track_loss``, the loss averaged over the rank's label tokens (per-token:
  the image samples get 4/424 of the gradient, a dilution of 16.96), and I4's gain in
  front of the final RMSNorm (true gradient zero, rounding noise injected, Adam with no
  weight decay on it): it drifts;
- ``sample``: the twins: each sample averaged over its own tokens, the gain decayed;
- ``logits``: per-token through ``attach(loss_from_logits=True)`` and ``tag_batch``, the
  loss a sum that FSDP2 divides by the job's tokens in its reduce-scatter
  (``set_gradient_divide_factor``, as torchtitan's global per-token loss), declared with
  ``attach(loss_reduction="sum", loss_scale=tokens)``;
- ``plain``: as ``token``, knowing nothing of trainvitals (for ``trainvitals run``);
- ``stage``: no tensor parallelism, ``fully_shard`` on the ``dp`` slice of a
  ``(stage, dp)`` mesh: no parameter spans the job, a layout not reasoned about.

Rank 0 writes the monitor's reports and, per report, every optimizer/params/adam figure
computed from the full tensors (``DTensor.full_tensor()``, ``_tp_models.truth``), and per
step the per-token weights autograd gives at the per-token losses (a tensor hook), one
``tp`` rank per data-parallel rank.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import warnings
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F

from tests.hooks._tp_models import VOCAB, Decoder, flat_report, full, parallelize, step_with_truth

SAMPLES, IMAGE_ROWS, SEQ = 25, (3, 9, 15, 21), 21
TEXT_ANSWER, IMAGE_ANSWER = 20, 1
TOKENS = len(IMAGE_ROWS) * IMAGE_ANSWER + (SAMPLES - len(IMAGE_ROWS)) * TEXT_ANSWER  # per rank: 424
STEPS, EVERY = 24, 4
SCALE_INIT, GAIN_LR, GAIN_EPS = 0.25, 0.3, 1e-8
NOISE, NEGATIVE_SHARE = 5e-9, 0.82  # I4's biased rounding noise (tests/e2e/_jobs.py's DriftJob)


class _Rounding(torch.autograd.Function):
    """The identity, whose gradient is ``noise``: what low-precision rounding leaves of a
    true gradient of zero (float32 on the CPU leaves the norm's eps term instead, 1e-6)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, noise: float) -> torch.Tensor:  # type: ignore[override]
        ctx.noise = noise
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return torch.full_like(grad, ctx.noise), None


class GainDecoder(Decoder):
    """``_tp_models.Decoder`` with its ``[1]`` gain in front of the final RMSNorm, which
    divides it out: its true gradient is zero up to rounding (I4's parameter)."""

    def __init__(self) -> None:
        super().__init__()
        with torch.no_grad():
            self.gain.fill_(SCALE_INIT)
        self.noise = torch.Generator().manual_seed(7)  # the same draws on every rank

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        negative = bool(torch.rand((), generator=self.noise) < NEGATIVE_SHARE)
        return self.head(self.norm(x * _Rounding.apply(self.gain, -NOISE if negative else NOISE)))


def batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs [25, 21], labels (-100 off the answers), the answers' mask and each sample's
    modality (1: image): text samples answer in 20 tokens, image samples in 1."""
    g = torch.Generator().manual_seed(1000 * dp_rank + step)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g)
    image = torch.zeros(SAMPLES, dtype=torch.long)
    image[list(IMAGE_ROWS)] = 1
    mask = torch.zeros(SAMPLES, SEQ, dtype=torch.bool)
    mask[image == 0, SEQ - TEXT_ANSWER :] = True
    mask[image == 1, SEQ - IMAGE_ANSWER :] = True
    labels = tokens[:, 1:].masked_fill(~mask, -100)
    return tokens[:, :-1], labels, mask, image


def optimizer(model: GainDecoder, gain_decay: float) -> torch.optim.Optimizer:
    rest = [p for n, p in model.named_parameters() if n != "gain"]
    groups = [
        {"params": [p for p in rest if p.ndim >= 2], "weight_decay": 0.1, "name": "decay"},
        {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0, "name": "no_decay"},
        {"params": [model.gain], "weight_decay": gain_decay, "lr": GAIN_LR, "eps": GAIN_EPS, "name": "gain"},
    ]
    # eps near the moments' size elsewhere: a fractional eps-dominated share to check
    return torch.optim.AdamW(groups, lr=0.02, eps=1e-4, foreach=False)


def main(rank: int, world: int, port: str, out: str, mode: str, steps: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    if port == "env":  # under torch.distributed.run
        dist.init_process_group("gloo", timeout=timeout)
    else:
        init = f"tcp://127.0.0.1:{port}"
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timeout)
    model = GainDecoder()
    if mode == "stage":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("stage", "dp"))
        dp_mesh, dp_rank, tp_rank = mesh["dp"], mesh.get_local_rank("dp"), mesh.get_local_rank("stage")
    else:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize(model, mesh["tp"])
        dp_mesh, dp_rank, tp_rank = mesh["dp"], mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    per_sample, summed = mode == "sample", mode == "logits"
    dp = world // 2
    if summed:  # the gradients summed over dp and divided by the job's tokens
        for module in (*model.blocks, model):
            module.set_gradient_divide_factor(float(TOKENS * dp))
            module.set_force_sum_reduction_for_comms(True)  # a sum, then the division (gloo has no PREMUL_SUM)
    opt = optimizer(model, gain_decay=0.1 if per_sample else 0.0)
    mon = None
    if mode != "plain":
        from trainvitals.hooks import attach

        mon = attach(
            model,
            opt,
            run=f"fsdp-tp-{mode}",
            sink=f"file:{Path(out).with_suffix('.jsonl')}",
            every=EVERY,
            modalities=("text", "image"),
            loss_from_logits=summed,
            update_sample=1 << 16,
            **({"loss_reduction": "sum", "loss_scale": TOKENS * dp} if summed else {}),
        )
    names = {id(p): n for n, p in model.named_parameters()}
    attached = {n: full(p) for n, p in model.named_parameters()}
    reports, truths, weights = [], [], []
    for step in range(1, steps + 1):
        tokens, labels, mask, image = batch(step, dp_rank)
        if mon is not None and mode == "logits":
            mon.tag_batch(modality=image)
        logits = model(tokens)
        per_token = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
        per_token = per_token.view(SAMPLES, SEQ)
        record: dict = {"step": step, "samples": SAMPLES, "image_samples": int(image.sum())}

        def grab(grad: torch.Tensor, record: dict = record, mask=mask, image=image) -> None:
            w = grad.detach().double()
            record["mass"] = float(w[mask].sum())
            record["image_mass"] = float(w[mask & (image == 1)[:, None]].sum())

        per_token.register_hook(grab)
        if mon is not None and mode in ("token", "sample", "stage"):
            mon.track_loss(per_token, mask=mask, modality=image)
        if per_sample:
            loss = (per_token.sum(1) / mask.sum(1)).mean()
        elif summed:
            loss = per_token.sum()
        else:
            loss = per_token.sum() / mask.sum()
        loss.backward()
        weights.append(record)
        reporting = mon is not None and mon.reporting_next
        found = step_with_truth(model, opt, names, attached, reporting)
        if found is not None:
            truths.append(found)
        opt.zero_grad(set_to_none=True)
        if reporting:
            assert mon is not None
            reports.append(flat_report(mon.latest()))
    coverage = {}
    if mon is not None:
        coverage = {e["signal"]: e for e in mon.latest_coverage()}
        mon.close()
    gain = float(full(model.gain)[0])
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (tp_rank == 0, weights))
    if rank == 0:
        result = {
            "weights": [w for first, w in everyone if first],  # one tp rank per data-parallel rank
            "dp": dp,
            # what autograd's weights at the per-token losses are divided by in the gradient
            "divisor": TOKENS * dp if summed else dp,
            "reports": reports,
            "truths": truths,
            "coverage": coverage,
            "gain": gain,
            "placements": {n: [repr(x) for x in getattr(p, "placements", ())] for n, p in model.named_parameters()},
        }
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    r, w, p, o, m = sys.argv[1:6]
    n = int(sys.argv[6]) if len(sys.argv) > 6 else STEPS
    if p == "env":
        r, w = os.environ["RANK"], os.environ["WORLD_SIZE"]
    main(int(r), int(w), p, o, m, n)
