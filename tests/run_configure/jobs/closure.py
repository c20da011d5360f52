"""A script that steps its optimizer with a closure that runs the backward, as Lightning
does (run by the tests under ``trainvitals run``): the gradients exist only once the
closure has run inside ``step()``."""

import torch
from torch import nn

torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)


def closure_for(step, x):
    def closure():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        norm = torch.stack([p.grad.norm() for p in model.parameters()]).norm()
        print(f"step {step} grad_norm {norm.item()!r}", flush=True)
        return loss

    return closure


for step in range(1, 5):
    opt.step(closure_for(step, torch.randn(8, 4)))
