"""Overhead of the hooks: monitored step over unmonitored step, side by side.

Two identical copies of the reference model (reference.py) train on the same batches; blocks
of steps alternate between them (interleaved, so machine noise hits both). A block
spans a whole number of report intervals and is timed as a whole, so the cost of
the report steps is amortized as it is in training; the median of the per-block
ratios is printed with its min and max.

    python tests/benchmarks/bench_overhead.py --every 1            # all signals every step
    python tests/benchmarks/bench_overhead.py --every 10           # the default interval
    python tests/benchmarks/bench_overhead.py --signals params,adam --every 1
    python tests/benchmarks/bench_overhead.py --signals none --track-loss --every 1
    python tests/benchmarks/bench_overhead.py --signals none --zero-code --every 10
    python tests/benchmarks/bench_overhead.py --device cuda --every 1 --track-loss --observe-logits

On a GPU each block is timed from a synchronized start to a synchronized end, so the
ratio counts the kernels the hooks add and the launches that hold the host up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmarks.reference import ACCUM, build, make_batches, synchronize, train_step
from trainvitals.hooks import attach


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--every", type=int, default=10, help="report interval (1: all signals every step)")
    ap.add_argument("--signals", default="all", help="built-in signals: all, none, or a list of optimizer,params,adam")
    ap.add_argument("--track-loss", action="store_true", help="call track_loss(..., output=logits) per micro-batch")
    ap.add_argument(
        "--zero-code",
        action="store_true",
        help="zero-code loss accounting: attach(loss_from_logits=True), micro-batches tagged "
        "by a forward pre-hook (no track_loss call)",
    )
    ap.add_argument("--observe-logits", action="store_true", help="call observe_logits(logits) per micro-batch")
    ap.add_argument("--blocks", type=int, default=6, help="blocks per arm (interleaved)")
    ap.add_argument(
        "--steps",
        type=int,
        default=0,
        help="steps per block (default: the report interval; rounded up to a multiple of it)",
    )
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for the model and batches on the GPU")
    ap.add_argument("--option", action="append", default=[], help="extra attach option name=value (int/float/str)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps = max(args.steps, 1)
    args.steps = -(-steps // args.every) * args.every

    signals = None if args.signals == "all" else (() if args.signals == "none" else tuple(args.signals.split(",")))
    options = {}
    for kv in args.option:
        k, v = kv.split("=", 1)
        for conv in (int, float):
            try:
                v = conv(v)
                break
            except ValueError:
                pass
        options[k] = v

    device = torch.device(args.device)
    base_model, base_opt = build(0, device)
    mon_model, mon_opt = build(0, device)
    if args.zero_code:
        options["loss_from_logits"] = True
    mon = attach(
        mon_model,
        mon_opt,
        run="bench",
        sink="null",
        every=args.every,
        signals=signals,
        modalities=("text", "image"),
        **options,
    )
    if args.zero_code:
        # The reference batches carry modality codes [0, 0, 0, 1]; a real job tags each batch.
        codes = make_batches(1, device=device)[0].modality
        mon_model.register_forward_pre_hook(lambda module, inputs: mon.tag_batch(modality=codes))
    batches = make_batches(ACCUM * 4, seed=1, device=device)

    def step(i: int, monitored: bool) -> float:
        micro = [batches[(i * ACCUM + k) % len(batches)] for k in range(ACCUM)]
        synchronize(device)
        t0 = time.perf_counter()
        if monitored:
            train_step(mon_model, mon_opt, micro, mon, track_loss=args.track_loss, observe_logits=args.observe_logits)
        else:
            train_step(base_model, base_opt, micro)
        synchronize(device)
        return time.perf_counter() - t0

    for i in range(args.warmup):
        step(i, False)
        step(i, True)
    # Line both arms up on a report boundary: the monitored model has taken `warmup` steps.
    i = args.warmup
    while not mon.reports_at(mon.step + 1) or mon.step == 0:
        step(i, True)
        step(i, False)
        i += 1
    ratios, base_all, mon_all = [], [], []
    for blk in range(args.blocks):
        order = (False, True) if blk % 2 == 0 else (True, False)
        total = {}
        for monitored in order:
            times = [step(i + k, monitored) for k in range(args.steps)]
            total[monitored] = sum(times)
            (mon_all if monitored else base_all).extend(times)
        i += args.steps
        ratios.append(total[True] / total[False])
    mon.close()
    what = (
        f"signals={args.signals} every={args.every}"
        + (f" on {args.device}" if device.type != "cpu" else "")
        + (" +track_loss(output)" if args.track_loss else "")
        + (" +zero_code" if args.zero_code else "")
        + (" +observe_logits" if args.observe_logits else "")
    )
    ratio = statistics.median(ratios)
    width = max(len(what), 12)
    print(f"{'configuration':<{width}} {'ms/step':>9} {'ratio median':>13} {'min':>7} {'max':>7}")
    print(f"{'unmonitored':<{width}} {statistics.median(base_all) * 1e3:9.1f} {'1.000':>13}")
    print(
        f"{what:<{width}} {statistics.median(mon_all) * 1e3:9.1f} {ratio:13.4f} {min(ratios):7.4f} {max(ratios):7.4f}"
    )
    print(f"({len(ratios)} interleaved blocks x {args.steps} steps; ratio of block totals)")
    print(
        f"ratio={ratio:.4f} ratio_min={min(ratios):.4f} ratio_max={max(ratios):.4f} "
        f"unmonitored_ms={statistics.median(base_all) * 1e3:.1f} monitored_ms={statistics.median(mon_all) * 1e3:.1f} "
        f"device={device.type}"
    )


if __name__ == "__main__":
    main()
