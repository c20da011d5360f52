"""Cost of the hooks against model size: expected linear, like one pass over memory.

For models of about 1M to 100M parameters (a stack of Linear layers with biases and
RMSNorm scales, AdamW without decay on the 1D ones), two costs are measured with one
torch thread, each as the median difference between twin setups timed side by side:

- per report: ``optimizer.step()`` at a report step (every built-in signal:
  optimizer statistics, 1D parameters, Adam state) minus the unmonitored twin's step;
- per step: the backward with the monitor's end-of-backward gradient norm minus the
  unmonitored twin's backward.

Printed per size: parameters, ms and ns per parameter for each cost, and one pass
over the parameters (a ``torch._foreach_norm``) for scale. Last line: ``key=value``.

    python tests/benchmarks/bench_scaling.py                       # 1M, 3M, 10M, 30M, 100M
    python tests/benchmarks/bench_scaling.py --sizes 1e6,1e7 --repeats 5
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

WIDTH_FOR = {1e6: 256, 3e6: 384, 1e7: 640, 3e7: 1024, 1e8: 1536}


class Stack(nn.Module):
    """``layers`` blocks of RMSNorm + Linear(width, width)."""

    def __init__(self, width: int, layers: int, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(nn.Sequential(nn.RMSNorm(width), nn.Linear(width, width)) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return x


def _model(size: float, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    width = WIDTH_FOR.get(size) or int(math.sqrt(size / 16))
    layers = max(1, round(size / (width * width + 2 * width)))
    model = Stack(width, layers, seed)
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=1e-4,
    )
    return model, opt


def _backward(model: nn.Module, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    model(x).square().mean().backward()
    return time.perf_counter() - t0


def _step(opt: torch.optim.Optimizer) -> float:
    t0 = time.perf_counter()
    opt.step()
    return time.perf_counter() - t0


def measure(size: float, repeats: int) -> dict[str, float]:
    base, base_opt = _model(size, 0)
    mon_model, mon_opt = _model(size, 0)
    mon = attach(mon_model, mon_opt, run="scaling", sink="null", every=1)
    width = base.blocks[0][1].in_features
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(0))
    report, per_step = [], []
    for r in range(repeats + 1):
        # Alternate which twin goes first, so neither always pays for the other's
        # freed memory (at 100M parameters a gradient set is 400 MB).
        if r % 2:
            m_back = _backward(mon_model, x)
            b_back = _backward(base, x)
            m_step = _step(mon_opt)
            b_step = _step(base_opt)
        else:
            b_back = _backward(base, x)
            m_back = _backward(mon_model, x)
            b_step = _step(base_opt)
            m_step = _step(mon_opt)
        base_opt.zero_grad(set_to_none=True)
        mon_opt.zero_grad(set_to_none=True)
        if r:  # the first round builds layouts and optimizer state
            per_step.append(m_back - b_back)
            report.append(m_step - b_step)
    mon.close()
    params = sum(p.numel() for p in base.parameters())
    grads = [torch.randn_like(p) for p in base.parameters()]
    t0 = time.perf_counter()
    for _ in range(3):
        torch._foreach_norm(grads)
    one_pass = (time.perf_counter() - t0) / 3
    return {
        "params": params,
        "report_ms": statistics.median(report) * 1e3,
        "step_ms": statistics.median(per_step) * 1e3,
        "pass_ms": one_pass * 1e3,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1e6,3e6,1e7,3e7,1e8", help="approximate parameter counts")
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(float(s), args.repeats) for s in args.sizes.split(",")]
    print(f"{'params':>11} {'report ms':>10} {'ns/param':>9} {'step ms':>8} {'ns/param':>9} {'1 pass ms':>10}")
    for r in rows:
        print(
            f"{r['params']:>11,} {r['report_ms']:10.1f} {r['report_ms'] * 1e6 / r['params']:9.2f} "
            f"{r['step_ms']:8.1f} {r['step_ms'] * 1e6 / r['params']:9.2f} {r['pass_ms']:10.1f}"
        )
    last = rows[-1]
    print(
        " ".join(
            [f"report_ns_per_param_{r['params']}={r['report_ms'] * 1e6 / r['params']:.2f}" for r in rows]
            + [f"report_passes_at_largest={last['report_ms'] / last['pass_ms']:.1f}"]
        )
    )


if __name__ == "__main__":
    main()
