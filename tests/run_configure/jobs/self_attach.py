"""A script that attaches trainvitals itself (run 'own'), then trains: under
``trainvitals run`` it keeps its own monitor, and trainvitals run does not add a second."""

import sys

import torch
from torch import nn

from trainvitals.hooks import attach

model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
mon = attach(model, opt, run="own", collector=sys.argv[1], every=2)
for _ in range(4):
    model(torch.randn(5, 4)).square().mean().backward()
    opt.step()
    opt.zero_grad()
mon.close()
