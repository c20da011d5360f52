"""Peak extra memory of a monitored training process.

Each arm trains the reference model (tests/benchmarks/reference.py) for ``--steps``
steps in a fresh process and reports its peak resident memory (VmHWM) and that of
any helper processes it started (wandb's offline service is one). The extra memory
of an arm is its peak over the unmonitored process's peak; the table shows the
median over ``--repeats`` processes per arm, the last line ``key=value``.

Arms: ``unmonitored``; ``every1`` (every signal on every step: optimizer, 1D
parameters, Adam, track_loss with the output hook, observe_logits per micro-batch;
the null sink, so the queue of reports is not counted); ``default`` (the same at
every=10); ``wandb`` (``wandb.watch(log="all", log_freq=1)``, offline; bench extra).

    python tests/benchmarks/bench_memory.py --steps 20 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARMS = ("unmonitored", "every1", "default", "wandb")


def _vm_hwm_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def child(arm: str, steps: int) -> None:
    """Run in the measured process: train, then print the peaks as JSON."""
    import torch

    sys.path.insert(0, str(ROOT))
    from tests.benchmarks.reference import ACCUM, build, make_batches, train_step

    torch.set_num_threads(1)
    model, opt = build(0)
    batches = make_batches(ACCUM * 4, seed=1)
    mon = run = None
    if arm in ("every1", "default"):
        from trainvitals.hooks import attach

        mon = attach(
            model, opt, run="mem", sink="null", every=1 if arm == "every1" else 10, modalities=("text", "image")
        )
    elif arm == "wandb":
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        run = wandb.init(project="trainvitals-bench", mode="offline", dir=tempfile.mkdtemp())
        wandb.watch(model, log="all", log_freq=1)
    helpers_peak = 0
    for i in range(steps):
        micro = [batches[(i * ACCUM + k) % len(batches)] for k in range(ACCUM)]
        train_step(model, opt, micro, mon, track_loss=mon is not None, observe_logits=mon is not None)
        if run is not None:
            run.log({"step": i})
        helpers_peak = max(helpers_peak, sum(_vm_hwm_kib(p) for p in _descendants(os.getpid())))
    own = _vm_hwm_kib(os.getpid())
    if mon is not None:
        mon.close()
    if run is not None:
        run.finish()
    print(json.dumps({"own_kib": own, "helpers_kib": helpers_peak}))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.steps)
        return
    names = args.arms.split(",")
    if "unmonitored" not in names:
        names.insert(0, "unmonitored")
    peaks: dict[str, list[tuple[int, int]]] = {n: [] for n in names}
    for _ in range(args.repeats):
        for n in names:
            out = subprocess.run(
                [sys.executable, __file__, "--child", n, "--steps", str(args.steps)],
                capture_output=True,
                text=True,
                check=True,
                cwd=ROOT,
            )
            got = json.loads(out.stdout.strip().splitlines()[-1])
            peaks[n].append((got["own_kib"], got["helpers_kib"]))
    base = statistics.median(own for own, _ in peaks["unmonitored"])
    print(f"{'arm':<12} {'peak MiB':>9} {'extra MiB':>10} {'helper processes MiB':>21}")
    figures = {}
    for n in names:
        own = statistics.median(o for o, _ in peaks[n])
        helpers = statistics.median(h for _, h in peaks[n])
        extra = (own - base) / 1024
        print(f"{n:<12} {own / 1024:9.1f} {extra:10.1f} {helpers / 1024:21.1f}")
        if n != "unmonitored":
            figures[f"extra_mib_{n}"] = f"{extra:.1f}"
            figures[f"helpers_mib_{n}"] = f"{helpers / 1024:.1f}"
    print(" ".join(f"{k}={v}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
