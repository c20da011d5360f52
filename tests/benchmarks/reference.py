"""The reference model and step, shared by every overhead benchmark.

Decoder-only transformer, 4 layers, d_model 256, 4 heads, RMSNorm, vocab 8192;
batches of 4 x 128 tokens, gradient accumulation 2, two modalities; AdamW
without weight decay on 1D parameters. On one CPU thread a step takes ~0.45 s,
small enough that fixed per-step costs show. ``device=`` puts the model and the
batches on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D_MODEL, HEADS, LAYERS, BATCH, SEQ, ACCUM = 8192, 256, 4, 4, 4, 128, 2


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.norm1 = nn.RMSNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm2 = nn.RMSNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyDecoder(nn.Module):
    def __init__(self, vocab: int = VOCAB, d: int = D_MODEL, heads: int = HEADS, layers: int = LAYERS, seq: int = SEQ):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("causal", torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.embed(ids) + self.pos[:t]
        for b in self.blocks:
            x = b(x, self.causal[:t, :t])
        return self.head(self.norm(x))


def make_optimizer(model: nn.Module, lr: float = 3e-4) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (no decay on 1D parameters)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": 0.1, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
        ],
        lr=lr,
    )


@dataclass
class Batch:
    ids: torch.Tensor  # [B, T]
    labels: torch.Tensor  # [B, T], -100 where no loss
    modality: torch.Tensor  # [B] 0 text, 1 image
    tokens: int  # label tokens, counted once on the host (no device read in the step)


def make_batches(n: int, seed: int = 0, device: str | torch.device = "cpu") -> list[Batch]:
    """Micro-batches: text rows with all tokens labelled, image rows with a short answer."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = ids.roll(-1, 1).clone()
        modality = torch.tensor([0, 0, 0, 1])
        labels[3, : SEQ - 16] = -100  # the "image" sample answers with 16 tokens
        tokens = int((labels != -100).sum())
        out.append(Batch(ids.to(device), labels.to(device), modality.to(device), tokens))
    return out


def build(seed: int = 0, device: str | torch.device = "cpu") -> tuple[TinyDecoder, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = TinyDecoder().to(device)
    return model, make_optimizer(model)


def synchronize(device: str | torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so a timer around a
    block of steps measures the work, not its launch."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def train_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    micro: list[Batch],
    mon=None,
    *,
    track_loss: bool = False,
    observe_logits: bool = False,
) -> None:
    """One optimizer step over ``micro`` (gradient accumulation), per-token loss
    normalized over the step's label tokens."""
    total = sum(b.tokens for b in micro)
    for b in micro:
        logits = model(b.ids)
        per_token = F.cross_entropy(
            logits.flatten(0, 1), b.labels.flatten(), reduction="none", ignore_index=-100
        ).view_as(b.labels)
        mask = b.labels != -100
        if mon is not None and track_loss:
            mon.track_loss(per_token, modality=b.modality, mask=mask, output=logits)
        if mon is not None and observe_logits:
            mon.observe_logits(logits, mask=mask)
        (per_token.sum() / total).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
