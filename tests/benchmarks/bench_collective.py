"""Cost of the agreed report collective against the unchecked one it replaced.

Two gloo ranks on the loopback, one torch thread each. For payloads of several sizes
(the partials of one report, split into 8 reduces of one signal each), one report's
cross-rank step is timed both ways, side by side in alternating rounds:

- ``plain``: the partials concatenated and all-gathered as they are, sum/max/min
  taken locally (what ``combine`` did before the header: a copy kept here);
- ``agreed``: :class:`trainvitals.hooks.distributed.ReportCollective`, the header
  (``HEADER`` float64) and the partials padded to the agreed capacity, the headers
  read and compared on the host, then the same local sums;
- ``apart``: the same with the headers gathered first over a gloo group of their own,
  the partials after them (the path an NCCL job takes, run here on gloo).

Printed per size: the median of each in microseconds over the rounds and the
difference, as wall time (which includes waiting for the other rank) and as the
calling thread's CPU time (the host work the header adds: building it, reading and
comparing the ranks' headers). Last line: ``key=value``.

    python tests/benchmarks/bench_collective.py
    python tests/benchmarks/bench_collective.py --sizes 64,1024,65536 --rounds 400
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainvitals.hooks import distributed
from trainvitals.hooks.step import StepContext

SIGNALS = 8


def plain(ctx: StepContext) -> None:
    """The report's collective before the header (the pre-change ``combine``)."""
    reduces, ctx.reduces = ctx.reduces, []
    packed = torch.cat([r.tensor.to(torch.float64) for r in reduces])
    world = dist.get_world_size()
    gathered = torch.empty(world * packed.numel(), dtype=packed.dtype)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(gathered, packed)
    gathered = gathered.view(world, -1)
    offset = 0
    for r in reduces:
        block = gathered[:, offset : offset + r.tensor.numel()]
        offset += r.tensor.numel()
        out = block.sum(0) if r.op == "sum" else block.amax(0) if r.op == "max" else block.amin(0)
        r.then(out.float())


def context(size: int, owners: list[object]) -> StepContext:
    ctx = StepContext(step=10, device=torch.device("cpu"))
    per = max(1, size // SIGNALS)
    for i, owner in enumerate(owners):
        ctx.reduce(torch.full((per,), float(i)), ("sum", "max", "min")[i % 3], lambda t: None)
        ctx.reduces[-1].owner = owner
    return ctx


def _rank(rank: int, world: int, port: int, sizes: list[int], rounds: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    owners = [object() for _ in range(SIGNALS)]
    members = [distributed.Member(f"signal{i}", owner=o) for i, o in enumerate(owners)]
    distributed.HEADER_APART = False
    agreed = distributed.ReportCollective()
    distributed.HEADER_APART = True
    apart = distributed.ReportCollective()  # makes its gloo group: every rank, here
    names = ("plain", "agreed", "apart")
    rows = []
    for size in sizes:
        times: dict[str, list[float]] = {n: [] for n in names}
        cpu: dict[str, list[float]] = {n: [] for n in names}
        for k in range(rounds + 20):  # the first 20 warm up (and agree the capacity)
            for name in names[k % 3 :] + names[: k % 3]:
                ctx = context(size, owners)
                dist.barrier()
                t0, c0 = time.perf_counter(), time.thread_time()
                if name == "plain":
                    plain(ctx)
                else:
                    (agreed if name == "agreed" else apart).combine(ctx, members)
                if k >= 20:
                    times[name].append(time.perf_counter() - t0)
                    cpu[name].append(time.thread_time() - c0)
        wall = [statistics.median(times[n]) * 1e6 for n in names]
        own = [statistics.median(cpu[n]) * 1e6 for n in names]
        rows.append((size, *wall, *own))
    if rank == 0:
        print(
            f"{'floats':>8} {'plain us':>10} {'agreed us':>10} {'apart us':>10}"
            f" {'plain cpu':>10} {'agreed cpu':>10} {'apart cpu':>10}  (world {world}, gloo, median of {rounds})"
        )
        for size, p, a, ap, cp, ca, cap in rows:
            print(f"{size:>8} {p:>10.1f} {a:>10.1f} {ap:>10.1f} {cp:>10.1f} {ca:>10.1f} {cap:>10.1f}")
        print(
            " ".join(
                f"extra_us_{s}={a - p:.1f} apart_extra_us_{s}={ap - p:.1f} extra_cpu_us_{s}={ca - cp:.1f}"
                for s, p, a, ap, cp, ca, cap in rows
            )
            + f" header_floats={distributed.HEADER}"
        )
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,1024,16384,262144")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    from tests.support import free_port

    sizes = [int(s) for s in args.sizes.split(",")]
    mp.spawn(_rank, args=(args.world, free_port(), sizes, args.rounds), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
