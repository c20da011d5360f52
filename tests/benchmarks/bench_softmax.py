"""Cost of the softmax saturation signal: milliseconds per ``observe_logits`` call.

Each configuration builds logits once, then runs reported steps (``every=1``) of
``--calls`` observe calls each (2: the reference job's two micro-batches) at the
default position cap, on one torch thread. Per configuration it prints the median
cost of one observe call, and the median cost per call *with its share of the
report* (the step's observe calls plus the signal's ``collect``, divided by the
calls): the signal may leave per-position work to the report, and that is paid
on the same thread. Time is the calling thread's CPU time (``time.thread_time``):
with one torch thread all the work runs there, and other processes sharing the
cores do not inflate it as they do wall time. ``observe_distillation`` is timed
on the reference shape too (two roles and the distillation pass).

    python tests/benchmarks/bench_softmax.py            # the table and a key=value line
    python tests/benchmarks/bench_softmax.py --runs 31 --threads 1

The last line holds ``key=value`` figures: ``observe_ms_<config>`` (one call),
``step_ms_<config>`` (one call with its share of the report), ``read_ms_<config>``
(one read pass over the same kept positions, ``amax(-1)``: the memory floor of any
statistic of them; ``x read`` is the call with its share over it) and
``lse_ms_<config>`` (a bare ``logsumexp(-1)`` of them, the naive one-statistic
cost: it makes full-size temporaries), e.g.
``observe_ms_512x8192`` for the reference decoder's [4, 128, 8192] float32 logits.
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
from trainvitals.hooks.signals.softmax import maths as sm

# (name, shape, dtype): the reference decoder's logits first (4 x 128 positions,
# 8192 classes; the cap keeps 171 of them, stride 3), then a plain [256, V] block
# (all 256 kept) at several vocabulary sizes and dtypes.
CONFIGS = [
    ("512x8192", (4, 128, 8192), torch.float32, 1.0),
    ("256x8192", (256, 8192), torch.float32, 1.0),
    ("256x8192_bf16", (256, 8192), torch.bfloat16, 1.0),
    ("256x32768", (256, 32768), torch.float32, 1.0),
    ("256x131072", (256, 131072), torch.float32, 1.0),
    # gaps up to ~450 nats: ~10 % of the classes give float32 subnormals at T = 1
    ("512x8192_x10", (4, 128, 8192), torch.float32, 10.0),
]


def lm_like_logits(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    """Logits with a spread of top-1 probabilities, from near uniform to > 0.999:
    a Gaussian bulk (scale 2) plus a random margin on one class per position, all
    times ``scale``."""
    g = torch.Generator().manual_seed(seed)
    v = shape[-1]
    z = torch.randn(shape, generator=g) * 2
    flat = z.view(-1, v)
    cls = torch.randint(0, v, (flat.shape[0], 1), generator=g)
    flat.scatter_add_(1, cls, torch.rand(flat.shape[0], 1, generator=g) * 30)
    return (z * scale).to(dtype)


def kept_positions(shape: tuple[int, ...], cap: int) -> int:
    """Positions the signal keeps per call (its documented stride)."""
    positions = math.prod(shape[:-1])
    stride = sm.subsample_stride(positions, cap, shape[1] if len(shape) == 3 else 1)
    return -(-positions // stride)


def kept_rows(logits: torch.Tensor, cap: int) -> torch.Tensor:
    """The positions the signal keeps, as [kept, V] (a strided view, as the signal reads them)."""
    shape = tuple(logits.shape)
    positions = math.prod(shape[:-1])
    stride = sm.subsample_stride(positions, cap, shape[1] if len(shape) == 3 else 1)
    return logits.reshape(-1, shape[-1])[::stride]


def pass_ms(fn, rows: torch.Tensor, runs: int, calls: int) -> float:
    """Median ms of ``fn(rows)``, timed like an observe call."""
    times = []
    for run in range(runs + 1):
        for _ in range(calls):
            t0 = time.thread_time()
            fn(rows)
            if run:
                times.append(time.thread_time() - t0)
    return statistics.median(times) * 1e3


def read_pass(rows: torch.Tensor) -> torch.Tensor:
    return rows.amax(-1)


def lse_pass(rows: torch.Tensor) -> torch.Tensor:
    return rows.logsumexp(-1)


def finish_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    opt.zero_grad()


def time_steps(mon, model: nn.Module, opt: torch.optim.Optimizer, call, runs: int, calls: int) -> tuple[float, float]:
    """Median ms of one call, and median ms per call with its share of the report."""
    signal = mon._softmax_signal()
    collect, collect_times = signal.collect, []

    def timed_collect(*args):
        t0 = time.thread_time()
        collect(*args)
        collect_times.append(time.thread_time() - t0)

    signal.collect = timed_collect
    per_call, per_step = [], []
    try:
        for run in range(runs + 1):  # the first step warms the allocator and the code paths
            reported = len(collect_times)
            times = []
            for _ in range(calls):
                t0 = time.thread_time()
                call()
                times.append(time.thread_time() - t0)
            finish_step(model, opt)
            if run:
                per_call.extend(times)
                per_step.append((sum(times) + sum(collect_times[reported:])) / calls)
    finally:
        signal.collect = collect
    return statistics.median(per_call) * 1e3, statistics.median(per_step) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=15, help="timed steps per configuration (medians)")
    ap.add_argument("--calls", type=int, default=2, help="observe calls per step")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default="", help="comma-separated configuration names")
    ap.add_argument(
        "--option",
        action="append",
        default=[],
        help="extra attach option name=value (int), e.g. softmax_max_positions=256",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    options = {k: int(v) for k, v in (kv.split("=", 1) for kv in args.option)}

    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = attach(model, opt, run="bench-softmax", sink="null", every=1, **options)
    cap = mon.config.softmax_max_positions
    figures = {}
    print(
        f"softmax signal, {args.threads} thread(s), softmax_max_positions={cap}, {args.calls} calls per "
        f"reported step, medians of {args.runs} steps (thread CPU time)"
    )
    print(
        f"{'config':<18}{'shape':<18}{'dtype':<10}{'kept':>6}{'ms/call':>9}{'+report':>9}{'ns/logit':>10}"
        f"{'read ns':>9}{'x read':>8}{'lse ns':>8}"
    )
    only = set(filter(None, args.only.split(",")))
    for name, shape, dtype, scale in CONFIGS:
        if only and name not in only:
            continue
        logits = lm_like_logits(shape, dtype, scale=scale)
        kept = kept_positions(shape, cap)
        ms, step_ms = time_steps(mon, model, opt, lambda x=logits: mon.observe_logits(x), args.runs, args.calls)
        rows = kept_rows(logits, cap)
        read, lse = pass_ms(read_pass, rows, args.runs, args.calls), pass_ms(lse_pass, rows, args.runs, args.calls)
        figures[f"observe_ms_{name}"] = ms
        figures[f"step_ms_{name}"] = step_ms
        figures[f"read_ms_{name}"] = read
        figures[f"lse_ms_{name}"] = lse
        ns = 1e6 / (kept * shape[-1])  # ms -> ns per kept logit
        print(
            f"{name:<18}{tuple(shape)!s:<18}{str(dtype).removeprefix('torch.'):<10}{kept:>6}"
            f"{ms:>9.2f}{step_ms:>9.2f}{step_ms * ns:>10.2f}{read * ns:>9.2f}{step_ms / read:>8.1f}{lse * ns:>8.2f}"
        )
    if not only or "distill_512x8192" in only:
        shape = (4, 128, 8192)
        student = lm_like_logits(shape, torch.float32, seed=1)
        teacher = lm_like_logits(shape, torch.float32, seed=2)
        ms, step_ms = time_steps(
            mon, model, opt, lambda: mon.observe_distillation(student, teacher, temperature=2.0), args.runs, args.calls
        )
        figures["distill_ms_512x8192"] = ms
        figures["distill_step_ms_512x8192"] = step_ms
        print(
            f"{'distill_512x8192':<18}{shape!s:<18}{'float32':<10}{kept_positions(shape, cap):>6}"
            f"{ms:>9.2f}{step_ms:>9.2f}{'':>10}"
        )
    mon.close()
    print(" ".join(f"{k}={v:.2f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
