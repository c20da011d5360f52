"""Loss accounting under DTensor tensor parallelism: the tiny decoder of
``tests/hooks/_tp_models.py`` (q/k/v/up column-wise, o/down row-wise) on a 1-D mesh of two
gloo ranks, trained on I1's batch, with the head either a plain replicated ``Linear``
(``head=plain``), a vocab-parallel ``ColwiseParallel(input_layouts=Replicate(),
use_local_output=False)`` whose logits are a ``Shard(-1)`` DTensor and whose loss runs under
``loss_parallel()`` (``head=vocab``: the per-token losses come back as a replicated
DTensor), or a column-wise head gathered back to a ``Replicate`` DTensor (``head=replicate``).

``python _tp_loss_job.py RANK WORLD PORT OUT key=value...`` (``tests.support.run_ranks``),
or under ``torchrun`` as ``python _tp_loss_job.py OUT key=value...`` (``mode=plain``: a job
that knows nothing of trainvitals, for ``trainvitals run``). Options:

- ``how=track|logits|plain``: ``attach`` + ``track_loss`` on the per-token losses;
  ``attach(loss_from_logits=True)`` with ``tag_batch``; no trainvitals at all.
- ``norm=token|sample``: the loss divided by the step's label tokens (I1: the image
  samples' short answers get little gradient) or the mean of the samples' means (the twin).
- ``drift=1``: a ``[1]`` gain in front of the final RMSNorm (which divides it out: its true
  gradient is zero), fed biased rounding noise below Adam's eps as in
  ``tests/e2e/_jobs.py``'s drift job, in a param group without weight decay (I4);
  ``fixed=1`` zeros that gradient (the fix), the twin.
- ``layout=fsdp``: no tensor parallelism: FSDP2 ``fully_shard`` on the same mesh of two
  (data parallel: the data-parallel size is 2; both ranks are given the same batch, so
  one rank's truth is the step's).
- ``tokens=shard``: the per-token losses redistributed ``Shard(0)`` (each rank holds
  other samples') before ``track_loss`` and the loss.
- ``steps``, ``every``, ``figures=1``: the optimizer/params/adam truth from full tensors.
- ``fault=K``: on rank 1 only, the vocabulary shards' maths raise at their K-th call
  (between the shards' two collectives' inputs): one rank's loss signal fails mid-step.

Each step is one micro-batch of 25 samples: 21 text samples of 40 label tokens and 4 image
samples (16%) whose answer is the last 2 tokens. The truth, independent of trainvitals: a
tensor hook on the per-token losses records autograd's weight at every token (the same on
both ranks: tensor parallelism's ranks see the same tokens); rank 0 writes it.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import warnings
from contextlib import nullcontext
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
warnings.simplefilter("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from tests.hooks._tp_models import VOCAB, Decoder, flat_report, full, parallelize, step_with_truth  # noqa: E402

SAMPLES, IMAGES, SEQ = 25, 4, 40
IMAGE_ANSWER = 2
NOISE, NEGATIVE_SHARE = 5e-9, 0.82
GAIN_INIT, LR = 0.25, 0.05


class _ZeroGradient(torch.autograd.Function):
    """The identity whose backward is zero: the fix for I4 where tensor hooks cannot
    reach the gain's gradient (FSDP2 runs the forward on an unsharded copy of it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(grad)


class GainDecoder(Decoder):
    """The decoder with its ``[1]`` gain in front of the final RMSNorm, which divides it out."""

    zero_gain_gradient = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        gain = _ZeroGradient.apply(self.gain) if self.zero_gain_gradient else self.gain
        return self.head(self.norm(x * gain))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens [B, S], targets [B, S], the label mask [B, S] and the modality codes [B]."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g)
    modality = torch.zeros(SAMPLES, dtype=torch.long)
    modality[torch.randperm(SAMPLES, generator=g)[:IMAGES]] = 1
    mask = torch.ones(SAMPLES, SEQ, dtype=torch.bool)
    mask[modality == 1, : SEQ - IMAGE_ANSWER] = False  # an image sample: only its answer is trained on
    return tokens[:, :-1], tokens[:, 1:], mask, modality


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    groups = [
        {"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1, "name": "decay"},
        {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0, "name": "no_decay"},
    ]
    return torch.optim.AdamW(groups, lr=LR, foreach=False)


def main(rank: int, world: int, out: str, opts: dict[str, str]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    how, head, norm = opts.get("how", "track"), opts.get("head", "plain"), opts.get("norm", "token")
    steps, every = int(opts.get("steps", "6")), int(opts.get("every", "1"))
    drift, fixed, figures = opts.get("drift") == "1", opts.get("fixed") == "1", opts.get("figures") == "1"
    torch.set_num_threads(1)
    model = GainDecoder()
    with torch.no_grad():
        model.gain.fill_(GAIN_INIT)
    mesh = init_device_mesh("cpu", (world,))
    if opts.get("layout") == "fsdp":  # data parallel instead: FSDP2 over the same mesh, whole params in forward
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        parallelize(model, mesh)
    if head == "vocab":
        parallelize_module(model, mesh, {"head": ColwiseParallel(input_layouts=Replicate(), use_local_output=False)})
    elif head == "replicate":
        plan = ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate(), use_local_output=False)
        parallelize_module(model, mesh, {"head": plan})
    noise = torch.Generator().manual_seed(7)  # the same on every rank: the gain is replicated
    if drift:

        def rounding_noise(grad: torch.Tensor) -> torch.Tensor:
            negative = torch.rand((), generator=noise) < NEGATIVE_SHARE
            return torch.full_like(grad, -NOISE if negative else NOISE)

        model.gain.register_hook(rounding_noise)
    if opts.get("layout") == "fsdp":  # a sharded gain's tensor hooks see no gradient
        model.zero_gain_gradient = fixed  # the fix, inside the forward FSDP runs
    elif fixed or not drift:  # the fix: its gradient zeroed (the RMSNorm's eps leaves a tiny true one)
        model.gain.register_hook(torch.zeros_like)
    names = {id(p): n for n, p in model.named_parameters()}
    opt = optimizer(model)
    mon = None
    if how != "plain":
        from trainvitals.hooks import attach

        mon = attach(
            model,
            opt,
            run="tploss",
            sink=f"file:{Path(out).with_suffix('.jsonl')}",
            every=every,
            modalities=("text", "image"),
            loss_from_logits=how == "logits",
        )
    if opts.get("fault") and rank == 1:  # the shard's maths raise on this rank only, at that step
        from trainvitals.hooks.signals.loss import sharded

        norms, calls = sharded.output_norms, [0]

        def failing(*args: object, **kwargs: object) -> torch.Tensor:
            calls[0] += 1
            if calls[0] == int(opts["fault"]):
                raise RuntimeError("injected on rank 1")
            return norms(*args, **kwargs)

        sharded.output_norms = failing
    attached = {n: full(p) for n, p in model.named_parameters()} if figures else {}
    recorded: list[dict] = []
    reports, truths = [], []
    for step in range(steps):
        tokens, targets, mask, modality = batch(step)
        if mon is not None and how == "logits":
            mon.tag_batch(modality=modality)
        logits = model(tokens)
        with loss_parallel() if head == "vocab" else nullcontext():
            labels = targets.reshape(-1)
            if head == "replicate":  # replicated logits: the targets a DTensor alike
                labels = DTensor.from_local(labels, mesh, [Replicate()], run_check=False)
            per_token = F.cross_entropy(logits.flatten(0, 1), labels, reduction="none")
            per_token = per_token.view(SAMPLES, SEQ)
            if opts.get("tokens") == "shard":  # each rank holds other samples' losses
                per_token = per_token.redistribute(mesh, [Shard(0)])
            weights: list[torch.Tensor] = []

            def grab(grad: torch.Tensor, _into: list = weights) -> None:
                local = getattr(grad, "to_local", None)
                _into.append((local() if local is not None else grad).detach().double().clone())

            per_token.register_hook(grab)
            if mon is not None and how == "track":
                mon.track_loss(per_token, mask=mask, modality=modality)
            m, lengths = mask.float(), mask.sum(dim=1).float()
            if isinstance(per_token, DTensor):  # the loss's other operands DTensors alike
                m = DTensor.from_local(m, mesh, [Replicate()], run_check=False)
                lengths = DTensor.from_local(lengths, mesh, [Replicate()], run_check=False)
            if norm == "token":
                loss = (per_token * m).sum() / mask.sum()
            else:
                loss = ((per_token * m).sum(dim=1) / lengths).mean()
            loss.backward()
        w = weights[0]
        if w.shape != mask.shape:  # a rank's shard of the losses: no truth recorded
            w = torch.zeros(mask.shape, dtype=torch.float64)
        recorded.append(
            {
                "mass": float(w[mask].sum()),
                "image": float(w[mask & (modality == 1)[:, None]].sum()),
                "samples": SAMPLES,
                "images": int((modality == 1).sum()),
                "nonlabel": float(w[~mask].abs().sum()),
            }
        )
        reporting = figures and mon is not None and mon.reporting_next
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
    gain = float(full(model.gain)[0])  # a collective for a DTensor: every rank
    if rank == 0:
        result = {
            "truth": recorded,
            "reports": reports,
            "truths": truths,
            "coverage": coverage,
            "gain": gain,
            "data_parallel_size": None if mon is None else mon.data_parallel_size,
        }
        Path(out).write_text(json.dumps(result))
    dist.barrier()


def _start() -> tuple[int, int, str, dict[str, str]]:
    """Under torchrun (RANK in the environment, the process group from it) or as a
    ``run_ranks`` worker (rank, world and port on the command line)."""
    if "RANK" in os.environ and "LOCAL_RANK" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        out, rest = sys.argv[1], sys.argv[2:]
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    else:
        rank, world, port, out, rest = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:]
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
    return rank, world, out, dict(kv.split("=", 1) for kv in rest)


if __name__ == "__main__":
    rank, world, out, opts = _start()
    try:
        main(rank, world, out, opts)
    finally:
        dist.destroy_process_group()
