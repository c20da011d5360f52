"""The training step waits for the device at most once per report.

A spy records, on the training thread, every call the hooks' own code makes that
reads a tensor on the host (``.item()``, ``.tolist()``, ``float(t)``, ``bool(t)``,
``.numpy()``) or copies one to the host (``.cpu()``, ``.to("cpu")`` or a copy into a
CPU tensor without ``non_blocking``). Over monitored steps with every signal on
(optimizer, parameters, Adam, loss accounting with the output hook and the probe,
softmax and distillation), there are no reads at all and exactly one host copy per
report: the packed report vector. Where CUDA is present the same steps also run on
the GPU under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainvitals
from trainvitals.hooks import attach

HOOKS_DIR = str(Path(trainvitals.hooks.__file__).parent)
READS = ("item", "tolist", "__float__", "__bool__", "__int__", "numpy")


# Reads of host copies that were started asynchronously and are checked for completion
# first (a CUDA event's query()), so the device is never waited for: the log-once value
# warnings read their counts this way, a step after they were taken.
COMPLETED_COPY_READERS = ("late_warnings.py",)


def _hooks_caller() -> str | None:
    """The file of the innermost trainvitals.hooks frame on the stack of the spied call
    (the hooks made the call, or a torch function they called did), or None."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(HOOKS_DIR):
            return Path(frame.f_code.co_filename).name
        frame = frame.f_back
    return None


def _names_the_host(device: object) -> bool:
    """A copy addressed to the host by name: ``.to("cpu")``. (On a CPU-only run the
    monitor's own device is the CPU too; copies to it are not transfers, and they are
    not addressed by name.)"""
    return isinstance(device, str) and torch.device(device).type == "cpu"


class TransferSpy:
    """Counts host reads and host copies made by hooks code on the creating thread."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: Counter[str] = Counter()
        main = threading.get_ident()

        def record(kind: str) -> None:
            if threading.get_ident() != main:
                return
            caller = _hooks_caller()
            if caller is None:
                return
            if kind in READS and caller in COMPLETED_COPY_READERS:
                kind = "read of a completed copy"
            self.calls[kind] += 1

        for name in (*READS, "cpu"):
            orig = getattr(torch.Tensor, name)

            def spy(t, *a, _orig=orig, _name=name, **k):
                record(_name)
                return _orig(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, spy)

        orig_to = torch.Tensor.to

        def to(t, *a, **k):
            device = k.get("device", a[0] if a and isinstance(a[0], (str, torch.device)) else None)
            if _names_the_host(device) and not k.get("non_blocking", False):
                record("to(cpu)")
            return orig_to(t, *a, **k)

        monkeypatch.setattr(torch.Tensor, "to", to)
        orig_copy = torch.Tensor.copy_

        def copy_(dst, src, non_blocking=False):
            if dst.device.type == "cpu" and src.device.type != "cpu" and not non_blocking:
                record("copy_(to cpu)")
            return orig_copy(dst, src, non_blocking)

        monkeypatch.setattr(torch.Tensor, "copy_", copy_)


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 16)
        self.norm = nn.RMSNorm(16)
        self.head = nn.Linear(16, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids)))


def _steps(
    device: torch.device, every: int, steps: int, spy_factory, record: list | None = None
) -> tuple[Counter, int]:
    """Warm-up steps, then ``steps`` measured ones; on a GPU the measured steps run under
    the sync debug mode (``"error"``: a synchronizing CUDA call raises). Setting the job
    up (the models and batches moved to the device, ``attach``) and the warm-up, which
    builds layouts and caches and uploads the signals' constants once (it takes the first
    report), are not steps and may wait for the device."""
    model = LM().to(device)
    teacher = LM().to(device)
    opt = torch.optim.AdamW(
        [
            {"params": [model.embed.weight, model.head.weight], "weight_decay": 0.1},
            {"params": [model.norm.weight, model.head.bias], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 64, (4, 12), generator=gen).to(device) for _ in range(4)]
    modality = torch.tensor([0, 0, 0, 1], device=device)
    mon = attach(model, opt, run="sync", sink="null", every=every, modalities=("text", "image"), probe_every=2)
    for k in range(max(2, every)):  # warm-up, up to the first report: built once, off the measured steps
        _one_step(mon, model, teacher, opt, batches, modality, k)
    reports = 0
    spy = spy_factory()
    for k in range(steps):
        reports += mon.reports_at(mon.step + 1)
        with _sync_debug(device):
            _one_step(mon, model, teacher, opt, batches, modality, k)
        if record is not None:  # reading the finished report is the test's, not the step's
            record.append((mon.step, mon.latest(), mon.latest_coverage()))
    calls = Counter(spy.calls) if spy is not None else Counter()  # before close()'s own report
    mon.close()
    return calls, reports


@contextlib.contextmanager
def _sync_debug(device: torch.device) -> Iterator[None]:
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _one_step(mon, model, teacher, opt, batches, modality, k) -> None:
    for micro in range(2):
        ids = batches[(2 * k + micro) % len(batches)]
        labels = ids.roll(-1, dims=1)
        logits = model(ids)
        per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
        mon.track_loss(per_token, modality=modality, output=logits)
        mon.observe_logits(logits, task="lm")
        with torch.no_grad():
            mon.observe_distillation(logits, teacher(ids), temperature=2.0, task="kd")
        (per_token.mean() / 2).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("every", [1, 3])
def test_at_most_one_host_transfer_per_report(monkeypatch, every):
    calls, reports = _steps(torch.device("cpu"), every, 6, lambda: TransferSpy(monkeypatch))
    reads = {k: v for k, v in calls.items() if k in READS}
    assert not reads, f"host reads in the hooks on the training thread: {reads}"
    copies = sum(v for k, v in calls.items() if k not in READS and k != "read of a completed copy")
    assert reports >= 2 and copies <= reports, (calls, reports)
    if torch.cuda.is_available():  # the same steps on the GPU: the debug mode raises on a sync
        on_gpu: list = []
        _steps(torch.device("cuda"), every, 6, lambda: None, on_gpu)
        # A signal that synced would have been turned off, not raised: its coverage says so.
        off = [e for _, _, coverage in on_gpu for e in coverage if not e["active"]]
        assert not off, off


def test_the_spy_sees_a_host_read_in_hooks_code(monkeypatch):
    """The spy works: an .item() in a signal's collect is caught."""
    from trainvitals.hooks.signals.optimizer.stats import OptimizerStats

    orig = OptimizerStats.collect

    def collect(self, monitor, ctx):
        torch.zeros(()).item()
        return orig(self, monitor, ctx)

    monkeypatch.setattr(OptimizerStats, "collect", collect)
    calls, _ = _steps(torch.device("cpu"), 1, 2, lambda: TransferSpy(monkeypatch))
    assert calls["item"] == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_gpu_reports_the_figures_the_cpu_reports():
    """The same steps on the GPU, every step a report, under the sync debug mode: every
    built-in signal is active there, and each report has the CPU's series in the CPU's
    order with the same values (to float32 rounding: the kernels sum in another order)."""
    on_cpu: list = []
    on_gpu: list = []
    _steps(torch.device("cpu"), 1, 4, lambda: None, on_cpu)
    _steps(torch.device("cuda"), 1, 4, lambda: None, on_gpu)
    assert [step for step, _, _ in on_gpu] == [step for step, _, _ in on_cpu]
    for (step, cpu, cpu_cov), (_, gpu, gpu_cov) in zip(on_cpu, on_gpu, strict=True):
        assert gpu_cov == cpu_cov, (step, gpu_cov)
        assert [(s["name"], s["labels"]) for s in gpu] == [(s["name"], s["labels"]) for s in cpu], step
        a = torch.tensor([s["value"] for s in cpu], dtype=torch.float64)
        b = torch.tensor([s["value"] for s in gpu], dtype=torch.float64)
        close = torch.isclose(a, b, rtol=1e-3, atol=1e-6, equal_nan=True)
        off = [(cpu[i]["name"], cpu[i]["labels"], a[i].item(), b[i].item()) for i in (~close).nonzero().flatten()]
        assert not off, f"step {step}: {len(off)} of {len(cpu)} figures differ on the GPU: {off[:20]}"
