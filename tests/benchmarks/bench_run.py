"""Overhead of ``trainvitals run``: the same unmodified training script, plain and under
``trainvitals run`` at the default interval, side by side.

The script (this file with ``--job``) trains the reference model (reference.py) on one torch
thread and knows nothing of trainvitals. Each run is a fresh process; the two arms
alternate (plain first on even runs), so machine noise hits both. Per run:

- loop: the training loop's time per step, over a whole number of report intervals
  after a warm-up (what a long job pays: the signals, the report steps, the
  zero-code loss accounting ``run`` turns on for this model's LM head), as wall time
  and as the training thread's CPU time (steadier on a busy machine; the sender
  thread's work is not in it, it runs beside the step);
- first step: the first optimizer step (under ``run`` it attaches: finds the model
  among the live objects, binds the signals);
- wall: the whole process, start-up included (the launcher's own start, the shim).

Medians over the runs; the ratios are of the medians. Reports go to a real collector
served by this process (``--sink file``: a JSONL file; ``null``: nowhere).

    python tests/benchmarks/bench_run.py                       # 5 runs per arm, every=10
    python tests/benchmarks/bench_run.py --runs 3 --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAINVITALS = str(Path(sys.executable).with_name("trainvitals"))


def job(steps: int, warmup: int) -> None:
    """The training script: plain PyTorch, timings printed as one JSON line."""
    sys.path.insert(0, str(ROOT))
    import torch

    from tests.benchmarks.reference import ACCUM, build, make_batches, train_step

    torch.set_num_threads(1)
    model, opt = build(0)
    batches = make_batches(ACCUM * 4, seed=1)

    def step(i: int) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.thread_time()
        train_step(model, opt, [batches[(i * ACCUM + k) % len(batches)] for k in range(ACCUM)])
        return time.perf_counter() - t0, time.thread_time() - c0

    first = step(0)[0]
    for i in range(1, warmup):
        step(i)
    times = [step(warmup + i) for i in range(steps)]
    print(
        "BENCH "
        + json.dumps(
            {
                "first_step_s": first,
                "loop_s_per_step": sum(t for t, _ in times) / steps,
                "loop_cpu_s_per_step": sum(c for _, c in times) / steps,
            }
        ),
        flush=True,
    )


def run_arm(monitored: bool, args: argparse.Namespace, sink: str) -> dict[str, float]:
    script = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--job",
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
    ]
    cmd = [TRAINVITALS, "run", "--run", "bench-run", "--collector", sink, "--", *script] if monitored else script
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINVITALS_")}
    env["OMP_NUM_THREADS"] = "1"
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{'run' if monitored else 'plain'} arm failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("BENCH "))
    if monitored and "trainvitals run: watching" not in proc.stderr:
        raise SystemExit(f"the run arm did not attach:\n{proc.stderr[-3000:]}")
    return {"wall_s": wall, **json.loads(line[len("BENCH ") :])}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="processes per arm (alternating)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per process (whole report intervals)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first one timed apart)")
    ap.add_argument("--sink", choices=("collector", "file", "null"), default="collector")
    ap.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.job:
        job(args.steps, args.warmup)
        return
    every = 10  # the default interval: trainvitals run is given no --every
    if args.steps % every:
        ap.error(f"--steps must be a multiple of the report interval ({every})")
    with ExitStack() as stack:
        if args.sink == "collector":
            sys.path.insert(0, str(ROOT))
            from trainvitals.monitor.app import create_app
            from trainvitals.monitor.server import serve_in_thread
            from trainvitals.monitor.settings import Settings

            sink = stack.enter_context(serve_in_thread(create_app(Settings(state_path=None))))
        elif args.sink == "file":
            sink = "file:" + str(Path(stack.enter_context(tempfile.TemporaryDirectory())) / "bench.jsonl")
        else:
            sink = "null"
        results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        for r in range(args.runs):
            for monitored in (False, True) if r % 2 == 0 else (True, False):
                results[monitored].append(run_arm(monitored, args, sink))
                print(
                    f"  run {r + 1}/{args.runs} {'run  ' if monitored else 'plain'} "
                    + " ".join(f"{k}={v:.3f}" for k, v in results[monitored][-1].items()),
                    file=sys.stderr,
                )

    def med(monitored: bool, key: str) -> float:
        return statistics.median(x[key] for x in results[monitored])

    rows = [
        ("loop ms/step", "loop_s_per_step", 1e3),
        ("loop CPU ms", "loop_cpu_s_per_step", 1e3),
        ("first step ms", "first_step_s", 1e3),
        ("wall s", "wall_s", 1.0),
    ]
    print(
        f"trainvitals run vs plain: reference model, 1 torch thread, every={every}, sink={args.sink}, "
        f"{args.runs} runs per arm, {args.steps} timed steps after {args.warmup}"
    )
    print(f"{'':<14} {'plain':>9} {'run':>9} {'ratio':>7}")
    # (ratio: run over plain, of the medians)
    for label, key, scale in rows:
        p, m = med(False, key), med(True, key)
        print(f"{label:<14} {p * scale:9.1f} {m * scale:9.1f} {m / p:7.3f}")
    loop_ratio = med(True, "loop_s_per_step") / med(False, "loop_s_per_step")
    cpu_ratio = med(True, "loop_cpu_s_per_step") / med(False, "loop_cpu_s_per_step")
    spread = [x["loop_s_per_step"] for x in results[True]] + [x["loop_s_per_step"] for x in results[False]]
    print(f"(medians over runs; loop per-step spread over all runs {min(spread) * 1e3:.1f}-{max(spread) * 1e3:.1f} ms)")
    print(
        f"ratio={loop_ratio:.4f} cpu_ratio={cpu_ratio:.4f} loop_ms_plain={med(False, 'loop_s_per_step') * 1e3:.1f} "
        f"loop_ms_run={med(True, 'loop_s_per_step') * 1e3:.1f} "
        f"first_step_ms_plain={med(False, 'first_step_s') * 1e3:.1f} "
        f"first_step_ms_run={med(True, 'first_step_s') * 1e3:.1f} "
        f"wall_s_plain={med(False, 'wall_s'):.2f} wall_s_run={med(True, 'wall_s'):.2f} "
        f"every={every} runs={args.runs}"
    )


if __name__ == "__main__":
    main()
