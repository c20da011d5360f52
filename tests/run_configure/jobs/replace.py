"""Scripts that step more than one optimizer over the same parameters (run by the tests
under ``trainvitals run``): ``finder``: a learning-rate finder's SGD for three steps, then
the real AdamW; ``overlap``: two optimizers that share some parameters, stepped in
turn; ``wrapper``: an optimizer that steps an inner AdamW inside its own step."""

import sys

import torch
from torch import nn


class Wrapper(torch.optim.Optimizer):
    """Steps an inner optimizer (as Lookahead or an accelerator's wrapper do)."""

    def __init__(self, inner):
        super().__init__([p for g in inner.param_groups for p in g["params"]], {})
        self.inner = inner

    @torch.no_grad()
    def step(self, closure=None):
        return self.inner.step(closure)


def train(model, opt, steps):
    for _ in range(steps):
        loss = model(torch.randn(8, 4)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1))
if sys.argv[1] == "finder":
    train(model, torch.optim.SGD(model.parameters(), lr=1e-4), 3)
    train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), 6)
elif sys.argv[1] == "overlap":  # two optimizers sharing the LayerNorm, stepped in turn
    first = torch.optim.Adam([*model[0].parameters(), *model[1].parameters()], lr=1e-3)
    second = torch.optim.Adam([*model[1].parameters(), *model[2].parameters()], lr=1e-3)
    for _ in range(2):
        train(model, first, 1)
        train(model, second, 1)
else:
    train(model, Wrapper(torch.optim.AdamW(model.parameters(), lr=1e-3)), 4)
print("trained", flush=True)
