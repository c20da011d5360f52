"""Fixed cost per report: a small model where the report, not the model, is the cost.

A 0.1M-parameter model (embedding, two RMSNorms, an MLP, an LM head; a 4-8 ms step on
one thread of the 2-core machine here) trains with AdamW, every built-in signal and
``track_loss`` with the output hook, reporting on every step. Three figures:

1. the monitored step over the unmonitored twin's, side by side (interleaved blocks,
   median with min and max), and their difference in ms per report: in wall time, and
   in the training thread's CPU time (all of our cost on that thread, the hooks in the
   forward and backward included, without the waits for the sender thread's lock);
2. where the training thread's time goes, per signal method, ``track_loss``, packing
   (thread CPU time per reported step, the mean over the profiled steps; the sender
   thread's encoding apart), and the median over those steps of the training thread's
   total (a shared machine adds bursts to some steps; the median is the typical report);
3. how many torch operations each part dispatches in one reported step (a
   ``TorchDispatchMode`` counter): a few to 20 us of dispatch each on a CPU, a kernel
   launch each on a GPU.

    python tests/benchmarks/bench_report_cost.py
    python tests/benchmarks/bench_report_cost.py --blocks 10 --steps 20 --profile-steps 200
    python tests/benchmarks/bench_report_cost.py --device cuda   # the same on a GPU

On a GPU the blocks are timed between synchronizations, and the thread CPU time is what
the training thread spends issuing our kernels (each torch op one launch or less).

Parts 2 and 3 wrap private methods of the monitor (its signals' ``collect``, the pack
step, the sender's encoder) to attribute time; they measure, they change nothing.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import trainvitals.hooks.distributed as distributed
import trainvitals.hooks.pack as pack_module
from trainvitals.hooks import attach
from trainvitals.hooks.lifecycle import StepLifecycle

VOCAB, D = 512, 64
MODALITY = torch.tensor([0] * 6 + [1] * 2)  # 8 samples: 6 text, 2 image
DEVICE = torch.device("cpu")  # --device


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def _model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Embedding(VOCAB, D),
        nn.RMSNorm(D),
        nn.Linear(D, 4 * D),
        nn.GELU(),
        nn.Linear(4 * D, D),
        nn.RMSNorm(D),
        nn.Linear(D, VOCAB),
    ).to(DEVICE)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _stepper(model: nn.Module, opt: torch.optim.Optimizer, mon: Any) -> Callable[[torch.Tensor], None]:
    modality = MODALITY.to(DEVICE)

    def step(ids: torch.Tensor) -> None:
        logits = model(ids)
        per_token = F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten(), reduction="none").view_as(ids)
        if mon is not None:
            mon.track_loss(per_token, modality=modality, output=logits)
        per_token.mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def side_by_side(batches: list[torch.Tensor], blocks: int, steps: int) -> dict[str, float]:
    base_model, base_opt = _model()
    mon_model, mon_opt = _model()
    mon = attach(mon_model, mon_opt, run="report-cost", sink="null", every=1, modalities=("text", "image"))
    arms = {"base": _stepper(base_model, base_opt, None), "mon": _stepper(mon_model, mon_opt, mon)}
    for i in range(3):  # layouts, optimizer state
        for step in arms.values():
            step(batches[i % len(batches)])
    ratios, per_report, cpu_per_report, totals_ms = [], [], [], {"base": [], "mon": []}
    for blk in range(blocks):
        order = ["base", "mon"] if blk % 2 == 0 else ["mon", "base"]
        took, cpu = {}, {}
        for name in order:
            _sync()
            t0, c0 = time.perf_counter(), time.thread_time()
            for k in range(steps):
                arms[name](batches[(blk * steps + k) % len(batches)])
            _sync()
            took[name], cpu[name] = time.perf_counter() - t0, time.thread_time() - c0
            totals_ms[name].append(took[name] / steps * 1e3)
        ratios.append(took["mon"] / took["base"])
        per_report.append((took["mon"] - took["base"]) / steps * 1e3)
        cpu_per_report.append((cpu["mon"] - cpu["base"]) / steps * 1e3)
    mon.close()
    return {
        "base_ms": statistics.median(totals_ms["base"]),
        "mon_ms": statistics.median(totals_ms["mon"]),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "report_ms": statistics.median(per_report),
        # The training thread's CPU time added per report, blocks side by side: all of it
        # (the hooks in the forward and backward, the report, what our work does to the
        # model's own ops), without the time it waits for the sender thread's lock.
        "report_cpu_ms": statistics.median(cpu_per_report),
    }


def _wrap(obj: Any, name: str, around: Callable[[str, Callable[[], Any]], Any], label: str) -> None:
    original = getattr(obj, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return around(label, lambda: original(*args, **kwargs))

    setattr(obj, name, wrapped)


LOSS_HOOKS = "loss hooks in the backward (per micro-batch)"
STEP_HOOKS = "step hooks, outside the parts"


def _attach_instrumented(model: nn.Module, opt: torch.optim.Optimizer, around: Any) -> Any:
    """``attach`` with the optimizer-step hooks wrapped (they are registered as bound
    methods at attach, so the class is patched for the call and restored at once): what
    they do outside the labelled parts is ours too."""
    originals = {name: getattr(StepLifecycle, name) for name in ("before_step", "after_step")}
    for name, fn in originals.items():

        def wrapped(self: Any, *a: Any, _fn: Any = fn, **k: Any) -> Any:
            return around(STEP_HOOKS, lambda: _fn(self, *a, **k))

        setattr(StepLifecycle, name, wrapped)
    try:
        mon = attach(model, opt, run="report-cost", sink="null", every=1, modalities=("text", "image"))
    finally:
        for name, fn in originals.items():
            setattr(StepLifecycle, name, fn)
    return mon


def _instrument(mon: Any, around: Callable[[str, Callable[[], Any]], Any]) -> Callable[[], None]:
    """Attribute the monitor's parts to labels; returns a function that undoes the
    module-level patches (the per-object ones go with the monitor)."""
    for signal in mon.signals:
        for meth in ("before_step", "after_step", "collect"):
            _wrap(signal, meth, around, f"{type(signal).__name__}.{meth}")
        history = getattr(signal, "_history", None)  # the end-of-backward gradient norm
        if history is not None:
            _wrap(history, "_measure", around, "gradient norm at the end of backward")
    _wrap(mon, "track_loss", around, "track_loss (per micro-batch)")
    loss = next((s for s in mon.signals if type(s).__name__ == "LossAccounting"), None)
    if loss is not None:  # its tensor hooks run in the backward, outside track_loss
        make = loss._hook

        def hook(where: str, fn: Callable[[Any], None]) -> Any:
            return make(where, lambda grad: around(LOSS_HOOKS, lambda: fn(grad)))

        loss._hook = hook
    _wrap(mon._sender, "_encode", around, "sender encoding (its own thread)")
    pack, combine = pack_module.pack, distributed.ReportCollective.combine
    pack_module.pack = lambda *a, **k: around("pack", lambda: pack(*a, **k))
    distributed.ReportCollective.combine = lambda self, *a, **k: around(  # type: ignore[method-assign]
        "loss emission (combine)", lambda: combine(self, *a, **k)
    )

    def undo() -> None:
        pack_module.pack = pack
        distributed.ReportCollective.combine = combine  # type: ignore[method-assign]

    return undo


PER_REPORT = "training thread, ours, per report"


def thread_time_profile(batches: list[torch.Tensor], steps: int) -> dict[str, Any]:
    """Thread CPU time per label, exclusive: a part's time inside another part is the
    inner part's alone, so the labels add up to all of our time on each thread. Under
    :data:`PER_REPORT`, the training thread's total of each reported step (ms), whose
    median is robust to the bursts a shared machine adds to some steps."""
    spent: collections.Counter[str] = collections.Counter()
    per_report: list[float] = []
    frames = threading.local()  # per thread: [label, time spent in nested parts]

    def around(label: str, call: Callable[[], Any]) -> Any:
        stack = frames.__dict__.setdefault("stack", [])
        if any(frame[0] == label for frame in stack):  # nested under the same label: counted once
            return call()
        stack.append([label, 0.0])
        t0 = time.thread_time()
        try:
            return call()
        finally:
            elapsed = time.thread_time() - t0
            _, nested = stack.pop()
            spent[label] += elapsed - nested
            if stack:
                stack[-1][1] += elapsed

    model, opt = _model()
    mon = _attach_instrumented(model, opt, around)

    step = _stepper(model, opt, mon)
    for i in range(3):  # the loss signal starts at the first track_loss: instrument it too
        step(batches[i % len(batches)])
    undo = _instrument(mon, around)
    try:
        for i in range(3):
            step(batches[i % len(batches)])
        spent.clear()

        def ours() -> float:
            return sum(v for k, v in spent.items() if "own thread" not in k)

        for i in range(steps):
            before = ours()
            step(batches[i % len(batches)])
            per_report.append((ours() - before) * 1e3)
        mon.flush(10)
    finally:
        undo()
        mon.close()
    return {**{k: v / steps * 1e3 for k, v in spent.items()}, PER_REPORT: per_report}


NOT_OURS = "model, loss and optimizer (not ours)"


def _our_site() -> str:
    """The innermost frame in the monitor's own code: where an op was called from."""
    for frame in reversed(traceback.extract_stack()):
        if f"{os.sep}trainvitals{os.sep}" in frame.filename or f"{os.sep}hooks{os.sep}" in frame.filename:
            return f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"
    return "?"


class _OpCounter(TorchDispatchMode):
    """Counts the ops the training thread dispatches, per label. The mode is
    thread-local in torch, so the sender thread's ops never reach it; the label is
    set only by the training thread (the sender's wrapped encoder runs on its own
    thread and must not relabel the step's ops)."""

    def __init__(self, sites: bool) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.sites: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.want_sites = sites
        self.where = NOT_OURS
        self.thread = threading.get_ident()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[self.where] += 1
        if self.want_sites and self.where != NOT_OURS:
            self.sites[(self.where, _our_site(), str(func.overloadpacket.__name__))] += 1
        return func(*args, **(kwargs or {}))


def op_counts(batches: list[torch.Tensor], sites: bool = False) -> tuple[dict[str, int], _OpCounter]:
    model, opt = _model()
    counter = _OpCounter(sites)

    def around(label: str, call: Callable[[], Any]) -> Any:
        if threading.get_ident() != counter.thread:
            return call()
        outer, counter.where = counter.where, label
        try:
            return call()
        finally:
            counter.where = outer

    mon = _attach_instrumented(model, opt, around)
    step = _stepper(model, opt, mon)
    for i in range(3):
        step(batches[i % len(batches)])
    undo = _instrument(mon, around)
    try:
        with counter:
            step(batches[3])
    finally:
        undo()
        mon.close()
    return dict(counter.counts), counter


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=10, help="blocks per arm (interleaved)")
    ap.add_argument("--steps", type=int, default=20, help="steps per block")
    ap.add_argument("--profile-steps", type=int, default=100)
    ap.add_argument("--op-sites", action="store_true", help="also list each part's ops by call site and op name")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for the model and batches on the GPU")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (8, 64), generator=g).to(DEVICE) for _ in range(8)]
    params = sum(p.numel() for p in _model()[0].parameters())

    sbs = side_by_side(batches, args.blocks, args.steps)
    where = "1 thread" if DEVICE.type == "cpu" else f"on {torch.cuda.get_device_name(DEVICE)}"
    print(f"small model, {params:,} parameters, every signal + track_loss(output), report every step, {where}")
    print(f"{'arm':<12} {'ms/step':>8} {'ratio median':>13} {'min':>7} {'max':>7}")
    print(f"{'unmonitored':<12} {sbs['base_ms']:8.2f} {'1.000':>13}")
    spread = f"{sbs['ratio_min']:7.3f} {sbs['ratio_max']:7.3f}"
    print(f"{'monitored':<12} {sbs['mon_ms']:8.2f} {sbs['ratio']:13.3f} {spread}")
    print(f"added per report (median of block differences): {sbs['report_ms']:.2f} ms")
    print(f"training thread's CPU time added per report (median of block differences): {sbs['report_cpu_ms']:.2f} ms")

    profile = thread_time_profile(batches, args.profile_steps)
    per_report = profile.pop(PER_REPORT)
    ops, counter = op_counts(batches, sites=args.op_sites)
    print()
    print(f"{'part (thread CPU time per reported step)':<48} {'ms':>7} {'torch ops':>10}")
    main_thread = 0.0
    for label, ms in sorted(profile.items(), key=lambda kv: -kv[1]):
        if "own thread" not in label:
            main_thread += ms
        print(f"{label:<48} {ms:7.3f} {ops.get(label, 0):>10}")
    ours = sum(n for label, n in ops.items() if label != NOT_OURS)
    for label in sorted(set(ops) - set(profile) - {NOT_OURS}):
        print(f"{label:<48} {'':>7} {ops[label]:>10}")
    print(f"{'training thread, ours in total':<48} {main_thread:7.3f} {ours:>10}")
    median = statistics.median(per_report)
    quartiles = statistics.quantiles(per_report, n=4)
    print(
        f"training thread, ours per reported step: median {median:.3f} ms "
        f"(quartiles {quartiles[0]:.3f} - {quartiles[2]:.3f}, mean {main_thread:.3f}, {len(per_report)} steps)"
    )
    loss_labels = [k for k in ops if "LossAccounting" in k or "loss" in k.split(" (")[0] or k == LOSS_HOOKS]
    loss_labels = [k for k in loss_labels if k != NOT_OURS]
    loss_ms = sum(profile.get(k, 0.0) for k in loss_labels)
    loss_ops = sum(ops[k] for k in loss_labels)
    print(f"{'loss accounting in total (' + ', '.join(sorted(loss_labels)) + ')'}: {loss_ms:.3f} ms, {loss_ops} ops")
    if args.op_sites:
        print()
        print("ops by part, call site and op name (one reported step)")
        for (label, site, name), n in sorted(counter.sites.items()):
            print(f"  {label:<44} {site:<52} {name:<24} {n:>4}")
    print(
        f"ratio={sbs['ratio']:.3f} ratio_min={sbs['ratio_min']:.3f} ratio_max={sbs['ratio_max']:.3f} "
        f"report_ms={sbs['report_ms']:.2f} report_cpu_ms={sbs['report_cpu_ms']:.2f} "
        f"training_thread_ms={main_thread:.2f} "
        f"training_thread_median_ms={median:.2f} torch_ops={ours} "
        f"unmonitored_ms={sbs['base_ms']:.2f} loss_ms={loss_ms:.3f} loss_ops={loss_ops} device={DEVICE.type}"
    )


if __name__ == "__main__":
    main()
