"""A training script a newcomer writes: ``attach(model, opt)`` and nothing else of
trainvitals, AdamW, 4 micro-batches a step whose losses go to backward without the
division by the accumulation count (incident I2); ``--fixed`` divides. ``--every N``
passes ``every=N`` to attach (a job with its own interval). Trains ``--steps`` steps."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from trainvitals.hooks import attach

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--fixed", action="store_true")
parser.add_argument("--every", type=int, default=None)
args = parser.parse_args()

torch.set_num_threads(1)
torch.manual_seed(0)
VOCAB, DIM, ACCUM = 64, 32, 4
model = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
run = "newcomer-fixed" if args.fixed else "newcomer"
mon = attach(model, opt, run=run) if args.every is None else attach(model, opt, run=run, every=args.every)
for _ in range(args.steps):
    for _micro in range(ACCUM):
        ids = torch.randint(0, VOCAB, (4, 12))
        loss = F.cross_entropy(model(ids).flatten(0, 1), ((ids * 7 + 3) % VOCAB).flatten())
        (loss / ACCUM if args.fixed else loss).backward()
    opt.step()
    opt.zero_grad()
mon.close()
print(f"trained {args.steps} steps")
