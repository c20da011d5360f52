"""Cost of the softmax saturation signal: milliseconds per ``observe_logits`` call.

Each configuration builds logits once, then times ``Monitor.observe_logits`` on a
reported step (``every=1``) at the default position cap, on one torch thread; the
median of several calls is printed (calls of one step just add up, so the step is
not finished between them). Time is the calling thread's CPU time
(``time.thread_time``): with one torch thread all the work runs there, and other
processes sharing the cores do not inflate it as they do wall time. ``observe_distillation`` is timed on the reference
shape too (two roles and the distillation pass).

    python tests/benchmarks/bench_softmax.py            # the table and a key=value line
    python tests/benchmarks/bench_softmax.py --runs 31 --threads 1

The last line holds ``key=value`` figures, e.g. ``observe_ms_512x8192=...`` for the
reference decoder's [4, 128, 8192] float32 logits.
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

from trainvitals.hooks import attach  # noqa: E402
from trainvitals.hooks.signals import softmax_math as sm  # noqa: E402

# (name, shape, dtype): the reference decoder's logits first (4 x 128 positions,
# 8192 classes; the cap keeps 171 of them, stride 3), then a plain [256, V] block
# (all 256 kept) at several vocabulary sizes and dtypes.
CONFIGS = [
    ("512x8192", (4, 128, 8192), torch.float32),
    ("256x8192", (256, 8192), torch.float32),
    ("256x8192_bf16", (256, 8192), torch.bfloat16),
    ("256x32768", (256, 32768), torch.float32),
    ("256x131072", (256, 131072), torch.float32),
]


def lm_like_logits(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Logits with a spread of top-1 probabilities, from near uniform to > 0.999:
    a Gaussian bulk (scale 2) plus a random margin on one class per position."""
    g = torch.Generator().manual_seed(seed)
    v = shape[-1]
    z = torch.randn(shape, generator=g) * 2
    flat = z.view(-1, v)
    cls = torch.randint(0, v, (flat.shape[0], 1), generator=g)
    flat.scatter_add_(1, cls, torch.rand(flat.shape[0], 1, generator=g) * 30)
    return z.to(dtype)


def kept_positions(shape: tuple[int, ...], cap: int) -> int:
    """Positions the signal keeps per call (its documented stride)."""
    positions = math.prod(shape[:-1])
    stride = sm.subsample_stride(positions, cap, shape[1] if len(shape) == 3 else 1)
    return -(-positions // stride)


def time_calls(call, runs: int) -> float:
    call()  # warm: allocator, code paths
    times = []
    for _ in range(runs):
        t0 = time.thread_time()
        call()
        times.append(time.thread_time() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=15, help="timed calls per configuration (median)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default="", help="comma-separated configuration names")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = attach(model, opt, run="bench-softmax", sink="null", every=1)
    cap = mon.config.softmax_max_positions
    figures = {}
    print(f"softmax signal, {args.threads} thread(s), softmax_max_positions={cap}, median of {args.runs} calls")
    print(f"{'config':<16}{'shape':<20}{'dtype':<10}{'kept':>6}{'ms/call':>10}{'ns/logit':>10}")
    only = set(filter(None, args.only.split(",")))
    for name, shape, dtype in CONFIGS:
        if only and name not in only:
            continue
        logits = lm_like_logits(shape, dtype)
        kept = kept_positions(shape, cap)
        ms = time_calls(lambda x=logits: mon.observe_logits(x), args.runs)
        figures[f"observe_ms_{name}"] = ms
        print(f"{name:<16}{str(tuple(shape)):<20}{str(dtype).removeprefix('torch.'):<10}{kept:>6}"
              f"{ms:>10.2f}{ms * 1e6 / (kept * shape[-1]):>10.2f}")
    if not only or "distill_512x8192" in only:
        student = lm_like_logits((4, 128, 8192), torch.float32, seed=1)
        teacher = lm_like_logits((4, 128, 8192), torch.float32, seed=2)
        ms = time_calls(lambda: mon.observe_distillation(student, teacher, temperature=2.0), args.runs)
        figures["distill_ms_512x8192"] = ms
        print(f"{'distill_512x8192':<16}{str((4, 128, 8192)):<20}{'float32':<10}"
              f"{kept_positions((4, 128, 8192), cap):>6}{ms:>10.2f}"
              f"{'':>10}")
    mon.close()
    print(" ".join(f"{k}={v:.2f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
