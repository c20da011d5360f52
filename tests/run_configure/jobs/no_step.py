"""A script that imports torch, builds a model and runs it, but never steps an optimizer
(an evaluation script, or a training loop whose step was forgotten)."""

import torch
from torch import nn

model = nn.Linear(4, 2)
opt = torch.optim.AdamW(model.parameters())
for _ in range(3):
    model(torch.randn(5, 4)).sum().backward()
print("done")
