"""Cost of the hooks against the number of parameter tensors, at a fixed total size.

A large model sharded for training holds hundreds to many thousands of parameter
tensors; what the hooks pay per tensor (Python calls, per-tensor kernels) grows with
that count, not with the model's size. Each configuration is a stack of Linear +
LayerNorm blocks (4 tensors a block: weight and bias each) whose width is chosen so
the total stays near ``--size`` parameters (1M by default) while the tensor count
goes from 100 to 10,000. A monitored model (every built-in signal, the default
report interval unless ``--every``) and its unmonitored twin train side by side
with AdamW, alternating which goes first; per round, each twin's backward and
``optimizer.step()`` are timed with the training thread's CPU time
(``time.thread_time``, one torch thread). Per configuration it prints the medians of:

- per backward: the monitored backward minus the twin's (the end-of-backward
  gradient norm: what every step pays, reported or not), and per tensor;
- per step: the monitored ``optimizer.step()`` minus the twin's on steps that do
  not report (the norm's per-step entry, the signals' bookkeeping);
- per report: the same on report steps (the statistics, packing and queuing).

    python tests/benchmarks/bench_tensors.py                      # 100, 1000, 10000 tensors
    python tests/benchmarks/bench_tensors.py --tensors 100,10000 --rounds 60 --every 5

Last line: ``key=value`` figures per tensor count (``backward_us_per_tensor_<n>``,
``report_ms_<n>`` ...).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainvitals.hooks import attach


class Stack(nn.Module):
    """``blocks`` residual blocks of Linear(width, width) + LayerNorm(width)."""

    def __init__(self, width: int, blocks: int, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width)) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return x


def shape_for(tensors: int, size: float) -> tuple[int, int]:
    """(width, blocks) for about ``tensors`` parameter tensors and ``size`` parameters."""
    blocks = max(1, tensors // 4)
    width = max(2, round(math.sqrt(size / blocks)))
    return width, blocks


def _model(width: int, blocks: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = Stack(width, blocks)
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=1e-4,
    )
    return model, opt


def _timed(fn) -> float:
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


def measure(tensors: int, size: float, rounds: int, every: int | None) -> dict[str, float]:
    width, blocks = shape_for(tensors, size)
    base, base_opt = _model(width, blocks)
    mon_model, mon_opt = _model(width, blocks)
    options = {} if every is None else {"every": every}
    mon = attach(mon_model, mon_opt, run="tensors", sink="null", **options)
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(0))
    twins = {"base": (base, base_opt), "mon": (mon_model, mon_opt)}
    backward: list[float] = []
    step: list[float] = []
    report: list[float] = []
    for r in range(rounds + 2):  # the first two rounds build layouts and optimizer state
        reporting = mon.reporting_next
        order = ("mon", "base") if r % 2 else ("base", "mon")
        back, opt_step = {}, {}
        for arm in order:
            model, _ = twins[arm]
            back[arm] = _timed(lambda m=model: m(x).square().mean().backward())
        for arm in order:
            _, opt = twins[arm]
            opt_step[arm] = _timed(opt.step)
            opt.zero_grad(set_to_none=True)
        if r < 2:
            continue
        backward.append(back["mon"] - back["base"])
        (report if reporting else step).append(opt_step["mon"] - opt_step["base"])
    mon.close()
    n = sum(1 for _ in base.parameters())
    params = sum(p.numel() for p in base.parameters())
    back_ms = statistics.median(backward) * 1e3
    return {
        "tensors": n,
        "params": params,
        "backward_ms": back_ms,
        "backward_us_per_tensor": back_ms * 1e3 / n,
        "step_ms": statistics.median(step) * 1e3 if step else math.nan,
        "report_ms": statistics.median(report) * 1e3 if report else math.nan,
        "reports": len(report),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", default="100,1000,10000", help="parameter tensor counts (about)")
    ap.add_argument("--size", type=float, default=1e6, help="total parameters (about), the same for every count")
    ap.add_argument("--rounds", type=int, default=40, help="timed rounds per configuration (medians)")
    ap.add_argument("--every", type=int, default=None, help="report interval (default: attach's default)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(int(t), args.size, args.rounds, args.every) for t in args.tensors.split(",")]
    print(
        f"hooks against parameter tensors, ~{args.size:,.0f} parameters, 1 torch thread, medians of "
        f"{args.rounds} rounds (thread CPU time, monitored minus unmonitored twin)"
    )
    print(
        f"{'tensors':>8} {'params':>10} {'backward ms':>12} {'us/tensor':>10} {'step ms':>8} "
        f"{'report ms':>10} {'reports':>8}"
    )
    for r in rows:
        print(
            f"{r['tensors']:>8} {r['params']:>10,} {r['backward_ms']:12.2f} {r['backward_us_per_tensor']:10.2f} "
            f"{r['step_ms']:8.2f} {r['report_ms']:10.1f} {r['reports']:>8}"
        )
    figures = []
    for r in rows:
        n = r["tensors"]
        figures += [
            f"backward_ms_{n}={r['backward_ms']:.2f}",
            f"backward_us_per_tensor_{n}={r['backward_us_per_tensor']:.2f}",
            f"step_ms_{n}={r['step_ms']:.2f}",
            f"report_ms_{n}={r['report_ms']:.1f}",
        ]
    print(" ".join(figures))


if __name__ == "__main__":
    main()
