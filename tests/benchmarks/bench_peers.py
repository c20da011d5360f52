"""trainvitals against its peers on the same model, in one run.

Copies of the reference model (tests/benchmarks/reference.py) train on the same
batches in interleaved blocks: unmonitored; trainvitals with every signal on every
step (track_loss with the output hook, observe_logits per micro-batch, optimizer,
1D parameter and Adam statistics); trainvitals at the default interval (every 10);
``wandb.watch(model, log="all", log_freq=1)`` in offline mode with a ``wandb.log``
per step; TensorBoard ``add_histogram`` of every parameter and every gradient each
step. Each arm's block time over the unmonitored block time is one ratio; the table
shows the median, min and max over blocks, and the last line the medians as
``key=value``. One torch thread (the machine is shared; ratios measured side by side).

    pip install -e '.[bench]'
    python tests/benchmarks/bench_peers.py                 # 4 blocks of 10 steps per arm
    python tests/benchmarks/bench_peers.py --blocks 6 --steps 10 --arms unmonitored,every1,wandb
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmarks.reference import ACCUM, build, make_batches, train_step
from trainvitals.hooks import attach

ARMS = ("unmonitored", "every1", "default", "wandb", "tensorboard")


def _arm(name: str, tmp: Path) -> tuple[Callable[[list], None], Callable[[], None]]:
    """(one optimizer step over micro-batches, close) for one arm, on its own model copy."""
    model, opt = build(0)
    if name == "unmonitored":
        return (lambda micro: train_step(model, opt, micro)), (lambda: None)
    if name in ("every1", "default"):
        mon = attach(
            model,
            opt,
            run=f"bench-{name}",
            sink="null",
            every=1 if name == "every1" else 10,
            modalities=("text", "image"),
        )
        return (lambda micro: train_step(model, opt, micro, mon, track_loss=True, observe_logits=True)), mon.close
    if name == "wandb":
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        run = wandb.init(project="trainvitals-bench", mode="offline", dir=str(tmp), reinit="finish_previous")
        wandb.watch(model, log="all", log_freq=1)
        step = {"n": 0}

        def wandb_step(micro: list) -> None:
            train_step(model, opt, micro)
            step["n"] += 1
            run.log({"step": step["n"]})

        return wandb_step, run.finish
    if name == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(tmp / "tb"))
        step = {"n": 0}

        def tb_step(micro: list) -> None:
            # Histograms of the gradients, taken before the optimizer clears them.
            for micro_batch in micro:
                train_step_no_update(model, micro_batch, len(micro))
            for n, p in model.named_parameters():
                writer.add_histogram(f"param/{n}", p.detach(), step["n"])
                if p.grad is not None:
                    writer.add_histogram(f"grad/{n}", p.grad, step["n"])
            opt.step()
            opt.zero_grad(set_to_none=True)
            step["n"] += 1

        return tb_step, writer.close
    raise ValueError(f"unknown arm {name!r}; choose from {ARMS}")


def train_step_no_update(model: torch.nn.Module, b, accum: int) -> None:
    """The forward and backward of one micro-batch of ``train_step`` (no optimizer step)."""
    import torch.nn.functional as F

    logits = model(b.ids)
    per_token = F.cross_entropy(logits.flatten(0, 1), b.labels.flatten(), reduction="none", ignore_index=-100)
    (per_token.sum() / ((b.labels != -100).sum() * accum)).backward()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {ARMS}")
    ap.add_argument("--blocks", type=int, default=4, help="blocks per arm (interleaved, rotating order)")
    ap.add_argument("--steps", type=int, default=10, help="steps per block (a whole report interval)")
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    names = args.arms.split(",")
    if names[0] != "unmonitored":
        names = ["unmonitored", *[n for n in names if n != "unmonitored"]]
    batches = make_batches(ACCUM * 4, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        arms = {n: _arm(n, Path(tmp)) for n in names}
        for i in range(args.warmup):
            for step, _ in arms.values():
                step([batches[(i * ACCUM + k) % len(batches)] for k in range(ACCUM)])
        ratios: dict[str, list[float]] = {n: [] for n in names if n != "unmonitored"}
        step_ms: dict[str, list[float]] = {n: [] for n in names}
        i = args.warmup
        for blk in range(args.blocks):
            order = names[blk % len(names) :] + names[: blk % len(names)]
            totals = {}
            for n in order:
                step, _ = arms[n]
                t0 = time.perf_counter()
                for k in range(args.steps):
                    step([batches[((i + k) * ACCUM + j) % len(batches)] for j in range(ACCUM)])
                totals[n] = time.perf_counter() - t0
                step_ms[n].append(totals[n] / args.steps * 1e3)
            i += args.steps
            for n in ratios:
                ratios[n].append(totals[n] / totals["unmonitored"])
        for _, close in arms.values():
            close()
    print(f"{'arm':<14} {'ms/step':>9} {'ratio median':>13} {'min':>7} {'max':>7}")
    print(f"{'unmonitored':<14} {statistics.median(step_ms['unmonitored']):9.1f} {'1.000':>13}")
    for n, r in ratios.items():
        print(f"{n:<14} {statistics.median(step_ms[n]):9.1f} {statistics.median(r):13.3f} {min(r):7.3f} {max(r):7.3f}")
    figures = {f"ratio_{n}": f"{statistics.median(r):.3f}" for n, r in ratios.items()}
    figures["unmonitored_ms"] = f"{statistics.median(step_ms['unmonitored']):.1f}"
    print(" ".join(f"{k}={v}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
