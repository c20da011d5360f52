"""Long runs stay flat: 300 steps with every signal on every step keep no autograd
graph and no growing memory (the per-token loss hook once kept every reported
step's graph alive: ~3.5 MiB a step)."""

from __future__ import annotations

import gc
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from trainvitals.hooks import attach

STEPS = 300


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096 / 2**20


def _graph_tensors() -> int:
    """Tensors that carry an autograd graph (``grad_fn``), alive now."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on some torch module objects warns
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None)


def _micro_batch(model: nn.Module, teacher: nn.Module, mon, gen: torch.Generator) -> None:
    ids = torch.randint(0, 200, (8, 16), generator=gen)
    labels = ids.roll(-1, dims=1)
    mask = torch.ones_like(labels, dtype=torch.bool)
    mask[6:, 8:] = False  # short image answers
    logits = model(ids)
    per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    mon.track_loss(per_token, modality=torch.tensor([0] * 6 + [1] * 2), mask=mask, output=logits)
    mon.observe_logits(logits, mask=mask, task="lm")
    with torch.no_grad():
        teacher_logits = teacher(ids)
    mon.observe_distillation(logits, teacher_logits, temperature=2.0, mask=mask, task="kd")
    ((per_token * mask).sum() / mask.sum() / 2).backward()


def test_300_steps_every_signal_every_step_keep_no_graph_and_flat_memory():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Embedding(200, 32), nn.RMSNorm(32), nn.Linear(32, 200))
    teacher = nn.Sequential(nn.Embedding(200, 32), nn.Linear(32, 200))
    opt = torch.optim.AdamW(
        [
            {"params": [model[0].weight, model[2].weight], "weight_decay": 0.1},
            {"params": [model[1].weight, model[2].bias], "weight_decay": 0.0},
        ],
        lr=1e-3,
    )
    baseline = _graph_tensors()
    rss: dict[int, float] = {}
    with attach(model, opt, run="long", sink="null", modalities=("text", "image"), every=1, probe_every=25) as mon:
        for step in range(1, STEPS + 1):
            for _ in range(2):
                _micro_batch(model, teacher, mon, gen)
            opt.step()
            opt.zero_grad()
            if step % 50 == 0:
                # Nothing of the step's graph outlives it (the loop holds no tensors here).
                assert _graph_tensors() == baseline, f"autograd graph kept after step {step}"
                rss[step] = _rss_mib()
        assert mon.value("modality_dilution_ratio", modality="image") is not None
        assert mon.value("softmax_top1_prob_mean", task="lm", role="student") is not None
    assert rss[STEPS] - rss[50] < 20, f"RSS grew {rss[STEPS] - rss[50]:.1f} MiB from step 50 to {STEPS}: {rss}"
