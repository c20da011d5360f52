"""A plain PyTorch training script that knows nothing of trainvitals (run by the tests
under ``trainvitals run``). Arguments: steps [--sleep S] [--exit CODE] [--wait-signal DIR]."""

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU())
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.body(x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("steps", type=int)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--exit", type=int, default=0)
    ap.add_argument("--wait-signal", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(1, args.steps + 1):
        x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        grad_norm = torch.stack([p.grad.norm() for p in model.parameters()]).norm()
        opt.step()
        # What the tests compare the reports with: the gradient norm before the update,
        # the parameter after it.
        print(f"step {step} grad_norm {grad_norm.item()!r} head.bias.max {model.head.bias.max().item()!r}", flush=True)
        time.sleep(args.sleep)
    if args.wait_signal:
        # The SIGUSR1 the test sends to `trainvitals run`'s pid lands here; the job then
        # dies of SIGTERM, which its parent must see as such.
        signal.signal(signal.SIGUSR1, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
        Path(args.wait_signal, "ready").write_text(str(os.getpid()))
        while True:
            time.sleep(0.05)
    sys.exit(args.exit)


if __name__ == "__main__":
    main()
