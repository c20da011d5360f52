"""One rank of the live-settings test under data parallelism: attach() with a collector,
then train slowly until the collector's settings have been in force for a while. Every
rank writes the steps it reported and its interval at each step.

    python ddp_live.py RANK WORLD PORT OUT COLLECTOR
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from trainvitals.hooks import attach

rank, world, port, out, collector = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 12), nn.LayerNorm(12), nn.Linear(12, 2))
ddp = DistributedDataParallel(model)
opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
mon = attach(ddp, opt, run="ddp-live", collector=collector, every=4)
torch.manual_seed(1 + rank)
reported, every = [], []
stop = torch.zeros(1)
step = 0
while True:
    step += 1
    loss = ddp(torch.randn(8, 6)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if mon._latest is not None and mon._latest.step == step:
        reported.append(step)
    every.append(mon.config.every)
    if rank == 0:
        mon.flush(2.0)  # the answer is in before the next step
        # Stop 12 steps after the collector's every=1 took effect (or give up at 400).
        since = len(every) - every.index(1) if 1 in every else 0
        stop.fill_(1.0 if since >= 12 or step >= 400 else 0.0)
    time.sleep(0.02)
    dist.broadcast(stop, 0)
    if stop.item():
        break
mon.close()
Path(out).with_name(f"rank{rank}.json").write_text(json.dumps({"reported": reported, "every": every}))
if rank == 0:
    Path(out).write_text(json.dumps({"steps": step}))
dist.destroy_process_group()
