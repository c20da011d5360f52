"""A tiny CPU training job that makes the hooks emit every signal they have.

Nothing here is healthy on purpose: the job exists to light up every metric of
the catalogue so the dashboards and the Prometheus path can be checked against
real data. Per optimizer step (reported every step):

- two micro-batches of different label-token counts, each per-token normalized on
  its own and halved (a mean of means: ``token_weight_spread_ratio`` > 1, and a
  per-token ``loss_norm_exponent`` of 1); text samples of 10-16 label tokens and
  image samples of 2-3 (two modalities, dilution > 1), with ``output=logits``
  (per-modality output gradient norms); ``probe_every=2`` adds the parameter-space
  probe (``modality_grad_cosine``, ``modality_grad_norm{scope="params"}``);
- ``observe_logits`` on the student and ``observe_distillation`` against a sharp
  teacher at temperature 2 (every softmax and distillation series);
- AdamW with weight decay on the matrices and none on the 1D parameters (the norm
  weight, the head's bias and a learnable input scale): ``param_weight_decay`` 0 and
  per-parameter Adam state for those, per-group state for the matrices. The scale's
  gradient is ~1e-4 of the others' (the norm divides it out).

Once per run, at fixed steps: a micro-batch with an infinite logit (a non-finite
loss, skipped as a GradScaler would: ``nonfinite_total{what="loss"}`` counts it),
a cleared optimizer state (``optimizer_state_resets_total``), and a first
micro-batch of samples packed into one row with restarting ``position_ids`` beside
an all-ones ``attention_mask``, which the model mixes over as given: the samples
see each other (``packing_samples_per_row``, ``packing_leak_sign`` and the probe's
``packing_leak_logit_change``, all ``cause="mask_beside_positions"``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainvitals.hooks import Monitor, attach

VOCAB, DIM = 32, 16
NONFINITE_AT = 3  # optimizer step (0-based) whose first micro-batch has an inf logit
RESET_AT = 5  # optimizer step (0-based) before which the optimizer state is cleared
PACKED_AT = 1  # optimizer step (0-based) whose first micro-batch is a leaking packed row
PACKED = [6, 5, 4]  # its samples' lengths


class TinyLM(nn.Module):
    """Embedding -> x scale -> RMSNorm -> Linear with bias.

    Given an ``attention_mask``, the embeddings first get a causal mean over the
    positions the mask keeps, taken as given whatever ``position_ids`` say (what a
    Hugging Face model does with a 2-D mask beside packed position ids): a packed row's
    samples see those before them. ``config``: a model config's fields the packing
    signal reads (no cache in training)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.config = SimpleNamespace(use_cache=False)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.scale = nn.Parameter(torch.tensor(0.25))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(
        self,
        ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.embed(ids) * self.scale
        if attention_mask is not None:
            keep = attention_mask[..., None].to(h.dtype)
            h = h + (h * keep).cumsum(1) / keep.cumsum(1).clamp_min(1.0)
        return self.head(self.norm(h))


def _micro_batch(
    gen: torch.Generator, text: list[int], image: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, labels, label mask [B, T] and per-sample modality codes [B] (0 text, 1 image)."""
    lengths = text + image
    width = max(lengths)
    ids = torch.randint(0, VOCAB, (len(lengths), width), generator=gen)
    labels = (ids * 7 + 3) % VOCAB
    noisy = torch.rand(ids.shape, generator=gen) < 0.5  # keeps the student's softmax soft
    labels = torch.where(noisy, torch.randint(0, VOCAB, ids.shape, generator=gen), labels)
    mask = torch.arange(width) < torch.tensor(lengths)[:, None]
    modality = torch.tensor([0] * len(text) + [1] * len(image))
    return ids, labels, mask, modality


def _packed_row(model: nn.Module, gen: torch.Generator, mon: Monitor) -> None:
    """One micro-batch of ``PACKED`` text samples in one row, restarting position ids
    beside an all-ones attention mask (the leak), trained on like the others."""
    ids, labels, mask, _ = _micro_batch(gen, [sum(PACKED)], [])
    positions = torch.cat([torch.arange(n) for n in PACKED])[None]
    mask = mask & (positions != 0)  # no label across a boundary
    logits = model(ids, position_ids=positions, attention_mask=torch.ones_like(ids))
    per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    mon.track_loss(per_token, modality=torch.tensor([0]), mask=mask, output=logits)
    ((per_token * mask).sum() / mask.sum() / 3).backward()


def train(
    mon: Monitor,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    seed: int = 0,
    before_step: Callable[[Monitor, int], None] | None = None,
) -> None:
    """``steps`` optimizer steps of two micro-batches each, observed by ``mon``;
    ``before_step(mon, step)`` runs first on each (0-based) step."""
    gen = torch.Generator().manual_seed(seed)
    micro = (([16, 14, 12], [3, 2]), ([10, 11], [2, 3, 2]))
    for step in range(steps):
        if before_step is not None:
            before_step(mon, step)
        if step == RESET_AT:
            opt.state.clear()  # as a rebuilt optimizer does
        if step == PACKED_AT:
            _packed_row(model, gen, mon)
        for i, (text, image) in enumerate(micro):
            ids, labels, mask, modality = _micro_batch(gen, text, image)
            logits = model(ids)
            if step == NONFINITE_AT and i == 0:
                overflow = torch.ones(len(ids), 1, 1)
                overflow[0] = math.inf
                bad = F.cross_entropy((logits * overflow).flatten(0, 1), labels.flatten(), reduction="none").view_as(
                    labels
                )
                mon.track_loss(bad, modality=modality, mask=mask)
                # What a GradScaler does with a non-finite loss: no backward for it.
                logits = model(ids)
            teacher = 6.0 * F.one_hot(labels, VOCAB).float() + torch.randn((*labels.shape, VOCAB), generator=gen)
            mon.observe_logits(logits.detach(), mask=mask, task="lm", role="student")
            mon.observe_distillation(logits.detach(), teacher, temperature=2.0, mask=mask, task="ie")
            per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
            mon.track_loss(per_token, modality=modality, mask=mask, output=logits)
            ((per_token * mask).sum() / mask.sum() / len(micro)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def make_job(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and an AdamW without weight decay on its 1D parameters."""
    model = TinyLM(seed)
    params = list(model.named_parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for _, p in params if p.ndim >= 2], "weight_decay": 0.1, "name": "decay"},
            {"params": [p for _, p in params if p.ndim < 2], "weight_decay": 0.0, "name": "no_decay"},
        ],
        lr=0.02,
    )
    return model, opt


def run_job(
    url: str, run: str, steps: int = 12, *, before_step: Callable[[Monitor, int], None] | None = None, **options: Any
) -> Monitor:
    """Train ``steps`` steps reporting every step to the collector at ``url``, deliver
    every report and close the monitor (its ``run_end`` report); return the monitor.
    ``before_step``: see :func:`train`; ``options`` go to ``attach``."""
    model, opt = make_job()
    options.setdefault("every", 1)
    options.setdefault("probe_every", 2)
    mon = attach(model, opt, run=run, collector=url, modalities=("text", "image"), **options)
    try:
        train(mon, model, opt, steps, before_step=before_step)
        if not mon.flush(30):
            raise AssertionError(f"run {run}: reports not delivered to {url} within 30 s")
    finally:
        mon.close()
    return mon
