"""A data-parallel script for torchrun (gloo, CPU): DDP over a small model, or, with
--no-group, ranks that never form a process group and train apart. Knows nothing of
trainvitals (run by the tests under ``trainvitals run -- torchrun ...``)."""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

group = "--no-group" not in sys.argv
torch.manual_seed(0)
torch.set_num_threads(1)
if group:
    dist.init_process_group("gloo")
model = nn.Sequential(nn.Linear(6, 12), nn.LayerNorm(12), nn.ReLU(), nn.Linear(12, 2))
wrapped = DistributedDataParallel(model) if group else model
opt = torch.optim.Adam(wrapped.parameters(), lr=1e-2)
torch.manual_seed(1 + int(os.environ["RANK"]))  # each rank its own data
for _step in range(6):
    loss = wrapped(torch.randn(8, 6)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
if group:
    dist.barrier()
    dist.destroy_process_group()
print("trained", flush=True)
