"""A plain training script, nothing of trainvitals in it, with incident I2: each of the
4 micro-batch losses goes to backward without the division by the accumulation count.
``--fixed`` divides. It trains ``--steps`` optimizer steps (200: far more than a
pre-flight check lets it run)."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--fixed", action="store_true")
args = parser.parse_args()

torch.set_num_threads(1)
torch.manual_seed(0)
VOCAB, DIM, ACCUM = 64, 32, 4
model = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB))
opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)  # the N-fold learning rate: a page
for _ in range(args.steps):
    for _micro in range(ACCUM):
        ids = torch.randint(0, VOCAB, (4, 12))
        logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), ((ids * 7 + 3) % VOCAB).flatten())
        (loss / ACCUM if args.fixed else loss).backward()
    opt.step()
    opt.zero_grad()
print(f"trained {args.steps} steps; loss {loss.item():.3f}")
