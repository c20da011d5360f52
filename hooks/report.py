"""From a step's tensors to a wire report: pack on the device, one host copy,
materialize on the pipeline thread.

The training thread only concatenates the step's statistics into one vector and
starts a (non-blocking, where the device allows) copy to the host. The pipeline
thread waits for that copy, turns the numbers into samples, and hands the report
to the sink. ``latest()`` materializes the newest report on demand.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from trainvitals.hooks.signals.base import StepContext
from trainvitals.wire import Report

log = logging.getLogger("trainvitals")


@dataclass
class PendingReport:
    """A report whose numbers may still be in flight to the host."""

    run: str
    step: int
    time: float
    rank: int
    layout: list[tuple[str, dict[str, str]]]
    flags: list[tuple[str, str, dict[str, str]]]  # deferred events, one value each after the samples
    events: list[dict[str, Any]]
    host: torch.Tensor
    ready: Any = None  # a CUDA event when the copy is asynchronous
    gated: list[int] = field(default_factory=list)  # layout indices with a presence value, after the flags
    _done: dict[str, Any] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def materialize(self) -> dict[str, Any]:
        with self._lock:
            if self._done is None:
                if self.ready is not None:
                    self.ready.synchronize()
                values = self.host.tolist()
                tail = values[len(self.layout) + len(self.flags):]
                absent = {i for i, p in zip(self.gated, tail) if not p > 0}
                samples = [
                    {"name": name, "labels": labels, "value": v}
                    for i, ((name, labels), v) in enumerate(zip(self.layout, values)) if i not in absent
                ]
                events = list(self.events)
                for (kind, detail, labels), v in zip(self.flags, values[len(self.layout):]):
                    if v > 0 and not math.isnan(v):
                        events.append({"kind": kind, "detail": detail, "labels": labels})
                self._done = {
                    "run": self.run, "step": self.step, "time": self.time, "rank": self.rank,
                    "samples": samples, "events": events,
                }
            return self._done


def pack(ctx: StepContext, *, run: str, rank: int) -> PendingReport:
    """Concatenate a context's values into one vector and start its copy to the host."""
    device = ctx.device
    dtype = torch.float32 if device.type == "mps" else torch.float64
    parts: list[torch.Tensor] = []
    layout: list[tuple[str, dict[str, str]]] = []
    gated: list[int] = []
    presence: list[torch.Tensor] = []
    for e in ctx.emits:
        parts.append(e.values.to(device=device, dtype=dtype, non_blocking=True))
        if e.present is not None:
            gated.extend(range(len(layout), len(layout) + len(e.labels)))
            presence.append(e.present.to(device=device, dtype=dtype, non_blocking=True))
        layout.extend((e.name, lab) for lab in e.labels)
    flags: list[tuple[str, str, dict[str, str]]] = []
    events: list[dict[str, Any]] = []
    for ev in ctx.events:
        if ev.flag is None:
            events.append({"kind": ev.kind, "detail": ev.detail, "labels": ev.labels})
        else:
            parts.append(ev.flag.to(device=device, dtype=dtype, non_blocking=True))
            flags.append((ev.kind, ev.detail, ev.labels))
    parts.extend(presence)  # after the flags: materialize reads them as the tail
    flat = torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=device)
    ready = None
    if flat.device.type == "cuda":
        host = torch.empty(flat.shape, dtype=dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
    else:
        host = flat.to("cpu")
    return PendingReport(run, ctx.step, time.time(), rank, layout, flags, events, host, ready, gated=gated)


class Pipeline:
    """The sender-side thread: materializes reports and hands them to the sink.

    Bounded: when the sink cannot keep up and ``max_pending`` reports wait, the
    oldest is dropped and counted. Never raises into the training thread.
    """

    def __init__(self, sink: Any, *, max_pending: int = 256,
                 on_report: Callable[[Report], Any] | None = None):
        self.sink = sink
        self.on_report = on_report
        self.dropped = 0
        self._q: queue.Queue[PendingReport | None] = queue.Queue()
        self._max_pending = max_pending
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="trainvitals-pipeline", daemon=True)
        self._thread.start()

    def put(self, report: PendingReport) -> None:
        with self._lock:
            if self._pending >= self._max_pending:
                self.dropped += 1
                return
            self._pending += 1
        self._q.put(report)

    def total_dropped(self) -> int:
        return self.dropped + int(getattr(self.sink, "dropped", 0))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            try:
                report = item.materialize()
                dropped = {"name": "client_dropped_reports_total", "labels": {}, "value": float(self.total_dropped())}
                report = {**report, "samples": [*report["samples"], dropped]}
                validated = Report.model_validate(report)
                self.sink.submit(validated.model_dump_json().encode())
                if self.on_report is not None:
                    self.on_report(validated)
            except Exception as exc:  # never let a bad report kill the thread
                self.dropped += 1
                if not self._warned:
                    self._warned = True
                    log.warning("trainvitals: could not send report of step %s: %s", item.step, exc)
            finally:
                with self._lock:
                    self._pending -= 1
                    self._idle.notify_all()

    def flush(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return self.sink.flush(max(0.0, deadline - time.monotonic()))

    def close(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self.flush(timeout)
        self._q.put(None)
        self._thread.join(timeout=max(0.1, deadline - time.monotonic()))
        self.sink.close(max(0.1, deadline - time.monotonic()))
