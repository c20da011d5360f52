"""From a step's tensors to a wire report: pack on the device, one host copy,
materialize on the sender thread.

The training thread only concatenates the step's statistics into one vector and
starts a (non-blocking, where the device allows) copy to the host. The sender
thread waits for that copy and turns the numbers into samples and events;
``Monitor.latest()`` materializes the newest report on demand.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import torch

from trainvitals.hooks.coverage import without_figures
from trainvitals.hooks.step import StepContext
from trainvitals.wire.coverage import MAX_COVERAGE_DETAIL

__all__ = ["PendingReport", "pack"]


@dataclass
class PendingReport:
    """A report whose numbers may still be in flight to the host."""

    run: str
    step: int
    time: float
    rank: int
    # Per emit (name, labels, series, gated, has presence): the layout, made when materialized
    emits: list[tuple[str, list[dict[str, str]], Any, list[int] | None, bool]]
    flags: list[tuple[str, str, dict[str, str]]]  # deferred events, one value each after the samples
    events: list[dict[str, Any]]
    host: torch.Tensor  # the values, float64 (float32 on MPS); the first of ``hosts`` when given
    ready: Any = None  # a CUDA event when the copy is asynchronous
    # On a CPU, one vector per dtype and (vector, start, count) per packed part, in order
    hosts: list[torch.Tensor] = field(default_factory=list)
    order: list[tuple[int, int, int]] = field(default_factory=list)
    coverage: list[dict[str, Any]] = field(default_factory=list)
    unless: list[tuple[str, str, str]] = field(default_factory=list)  # (signal, reason, detail), values after flags
    final: frozenset[str] = frozenset()  # signals whose entry the flags do not change
    settled: bool = False  # coverage judged against another report's figures (run_end): kept
    settle: Any = None  # called once with (coverage as made, coverage after the flags)
    layout: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # per sample, when materialized
    gated: list[int] = field(default_factory=list)  # layout indices with a presence value, after the flags
    starts: list[int] = field(default_factory=list)  # per emit, its first sample in the layout; then the end
    # Per StepContext.on_host: (emit, flagged event, verdict) it goes before, its parts' sizes,
    # its function, the signal that added it; their values are the last ones, after the
    # warnings' counts
    sections: list[tuple[tuple[int, int, int], list[int], Any, Any]] = field(default_factory=list)
    # (raw start, raw count, finish) per emit whose values the sender thread finishes, in
    # order; ``raw`` counts the packed values of the emits, which then differ from the layout's
    finishes: list[tuple[int, int, Any]] = field(default_factory=list)
    raw: int = 0
    # ((key, message) pairs, value count, positive_from, warn) per StepContext.warn_when,
    # their values after the presence values
    warns: list[tuple[tuple[tuple[str, str], ...], int, int | None, Any]] = field(default_factory=list)
    _done: dict[str, Any] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def materialize(self) -> dict[str, Any]:
        with self._lock:
            if self._done is None:
                samples, events, verdicts = self._pieces()
                coverage = [dict(e) for e in self.coverage]
                turned = set(self.final)
                for signal, reason, detail in verdicts:
                    if signal not in turned:
                        turned.add(signal)
                        for e in coverage:
                            if e["signal"] == signal:
                                e.update(active=False, reason=reason, detail=detail)
                if not self.settled:
                    without_figures(coverage, samples)
                self._done = {
                    "run": self.run,
                    "step": self.step,
                    "time": self.time,
                    "rank": self.rank,
                    "samples": samples,
                    "events": events,
                }
                if coverage:
                    self._done["coverage"] = coverage
                    if self.settle is not None:
                        self.settle(self.coverage, coverage)
            return self._done

    def _pieces(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[tuple[str, str, str]]]:
        """The report's samples, events and the coverage verdicts that hold, in order;
        the log-once warnings whose counts are > 0 are said here (a section's when it
        runs)."""
        if self.ready is not None:
            self.ready.synchronize()
        values, section_parts = self._values()
        subs = self._run_sections(section_parts) if self.sections else []
        self._layout()
        if self.finishes:
            values = self._finished(values)
        layout = self.layout
        n_flags = len(layout) + len(self.flags)
        at = n_flags + len(self.unless)
        tail = values[at : at + len(self.gated)]
        absent = {i for i, p in zip(self.gated, tail, strict=True) if not p > 0}
        if self.warns:
            self._warn(values[at + len(self.gated) :])
        flag_values, unless_values = values[len(layout) : n_flags], values[n_flags:at]
        # Each section's pieces go where it was added: after the samples, flagged events
        # and verdicts written before it, before those written after it.
        cuts: list[tuple[int, int, int, Any]] = [(self.starts[e], f, u, sub) for (e, f, u), sub in subs]
        cuts.append((len(layout), len(self.flags), len(self.unless), None))
        samples: list[dict[str, Any]] = []
        events = list(self.events)
        verdicts: list[tuple[str, str, str]] = []
        s0 = f0 = u0 = 0
        for s1, f1, u1, sub in cuts:
            if absent:
                samples.extend(
                    {"name": name, "labels": labels, "value": values[i]}
                    for i, (name, labels) in enumerate(layout[s0:s1], s0)
                    if i not in absent
                )
            else:
                samples.extend(
                    {"name": name, "labels": labels, "value": v}
                    for (name, labels), v in zip(layout[s0:s1], values[s0:s1], strict=True)
                )
            events.extend(
                {"kind": kind, "detail": detail, "labels": labels}
                for (kind, detail, labels), v in zip(self.flags[f0:f1], flag_values[f0:f1], strict=True)
                if v > 0 and not math.isnan(v)
            )
            verdicts.extend(u for u, v in zip(self.unless[u0:u1], unless_values[u0:u1], strict=True) if v > 0)
            if sub is not None:
                samples.extend(sub[0])
                events.extend(sub[1])
                verdicts.extend(sub[2])
            s0, f0, u0 = s1, f1, u1
        return samples, events, verdicts

    def _run_sections(self, host_parts: list[torch.Tensor]) -> list[tuple[tuple[int, int, int], Any]]:
        """Run the sections (:meth:`StepContext.on_host`) on the host copies of their
        parts, each into a context of its own; returns each section's place (emit,
        flagged event, verdict) with its pieces."""
        subs: list[tuple[tuple[int, int, int], Any]] = []
        cpu = torch.device("cpu")
        i = 0
        for at, sizes, run, owner in self.sections:
            sub = StepContext(step=self.step, device=cpu)
            mine = host_parts[i : i + len(sizes)]
            i += len(sizes)
            try:
                run(sub, mine)
                pieces = pack(sub, run=self.run, rank=self.rank)._pieces()
            except Exception as exc:
                if owner is None:
                    raise
                # Only the section is lost: its signal says so here and is turned off at
                # its next call on the training thread.
                owner.fail_later("the sender thread", exc)
                failed = f"{type(owner).__name__} failed in the sender thread: {type(exc).__name__}: {exc}"
                verdict = [] if owner.covers is None else [(owner.covers, "failed", failed[:MAX_COVERAGE_DETAIL])]
                subs.append((at, ([], [], verdict)))
                continue
            always = [(signal, reason, detail) for signal, (reason, detail) in sub.verdicts().items()]
            subs.append((at, (pieces[0], pieces[1], always + pieces[2])))
        return subs

    def _warn(self, values: list[float]) -> None:
        """The log-once warnings whose counts turned out > 0 (the last values)."""
        at = 0
        for warnings, count, positive_from, warn in self.warns:
            mine = values[at : at + count]
            at += count
            counts = mine if positive_from is None else [sum(1 for v in mine[positive_from:] if v > 0)]
            for (key, message), n in zip(warnings, counts, strict=True):
                if n > 0:
                    warn(key, message, int(n))

    def _values(self) -> tuple[list[float], list[torch.Tensor]]:
        """The packed values as floats, in the order they were packed, and apart the
        sections' parts as host tensors (packed last; their functions read them as
        tensors, and they may be large: never turned into floats)."""
        sizes = [size for _, mine, _, _ in self.sections for size in mine]
        if not self.hosts:
            host = self.host
            if not sizes:
                return host.tolist(), []
            cut = host.numel() - sum(sizes)
            return host[:cut].tolist(), list(host[cut:].split(sizes))
        own = self.order[: len(self.order) - len(sizes)]
        parts = [self.hosts[g][start : start + count] for g, start, count in self.order[len(own) :]]
        ends = [0] * len(self.hosts)  # each dtype's parts lie in packing order: a prefix of it
        for g, start, count in own:
            ends[g] = start + count
        lists = [
            h[:end].tolist() if h.is_floating_point() else [float(v) for v in h[:end].tolist()]
            for h, end in zip(self.hosts, ends, strict=True)
        ]
        values: list[float] = []
        for g, start, count in own:
            values.extend(lists[g][start : start + count])
        return values, parts

    def _layout(self) -> None:
        """(name, labels) per sample, and the samples with a presence value."""
        layout: list[tuple[str, dict[str, str]]] = []
        gated: list[int] = []
        starts: list[int] = []
        extend = layout.extend
        for name, labels, series, gates, has_presence in self.emits:
            start = len(layout)
            starts.append(start)
            if series is None:
                extend(zip(repeat(name), labels))
            else:
                for block_name, labs in series:
                    extend(zip(repeat(block_name), labs))
            if has_presence:
                gated.extend(range(start, len(layout)) if gates is None else (start + i for i in gates))
        starts.append(len(layout))
        self.layout, self.gated, self.starts = layout, gated, starts

    def _finished(self, raw: list[float]) -> list[float]:
        """The packed values with each finished emit's raw values replaced by what its
        finish makes of them (one value per labels entry; checked)."""
        out: list[float] = []
        at = 0
        for start, count, finish in self.finishes:
            out.extend(raw[at:start])
            done = finish(raw[start : start + count])
            out.extend(done)
            at = start + count
        out.extend(raw[at:])
        if len(out) - (len(raw) - self.raw) != len(self.layout):
            raise ValueError(f"the finished values are {len(out)} for a layout of {len(self.layout)} and the flags")
        return out


def pack(ctx: StepContext, *, run: str, rank: int) -> PendingReport:
    """Concatenate a context's values into one vector and start its copy to the host."""
    device = ctx.device
    dtype = torch.float32 if device.type == "mps" else torch.float64
    parts: list[torch.Tensor] = []
    emits: list[tuple[str, list[dict[str, str]], Any, list[int] | None, bool]] = []
    presence: list[torch.Tensor] = []
    finishes: list[tuple[int, int, Any]] = []
    raw = 0
    for e in ctx.emits:
        parts.append(e.values)
        count = e.values.numel()
        if e.host is not None:
            finishes.append((raw, count, e.host))
        raw += count
        if e.present is not None:
            presence.append(e.present)
        emits.append((e.name, e.labels, e.series, e.gated, e.present is not None))
    flags: list[tuple[str, str, dict[str, str]]] = []
    events: list[dict[str, Any]] = []
    for ev in ctx.events:
        if ev.flag is None:
            events.append({"kind": ev.kind, "detail": ev.detail, "labels": ev.labels})
        else:
            parts.append(ev.flag)
            flags.append((ev.kind, ev.detail, ev.labels))
    unless = [u for u in ctx.unless if u.flag is not None]  # the others are in ctx.coverage already
    parts.extend(u.flag for u in unless if u.flag is not None)
    parts.extend(presence)  # after the flags: materialize reads them as the tail
    parts.extend(w.values for w in ctx.warns)  # and the warnings' counts
    common = _report_fields(run, ctx.step, rank, emits, flags, events, ctx, unless, finishes, raw)
    if ctx.sections:  # the sections' parts last
        common["sections"] = _sections(ctx)
        for sec in ctx.sections:
            parts.extend(sec.parts)
    if device.type == "cpu" and parts:
        by_dtype = _by_dtype(parts)
        if by_dtype is not None:
            hosts, order = by_dtype
            return PendingReport(**common, host=hosts[0], hosts=hosts, order=order)
    if not parts:
        flat = torch.zeros(0, dtype=dtype, device=device)
    elif all(p.device == device for p in parts):
        flat = torch.cat(parts).to(dtype)  # one op: cat promotes the dtypes
    else:  # a signal's tensors on another device (the loss on its own GPU)
        flat = torch.cat([p.to(device=device, dtype=dtype, non_blocking=True) for p in parts])
    ready = None
    if flat.device.type == "cuda":
        host = torch.empty(flat.shape, dtype=dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
    else:
        host = flat.to("cpu")
    return PendingReport(**common, host=host, ready=ready)


def _report_fields(
    run: str,
    step: int,
    rank: int,
    emits: list[Any],
    flags: list[tuple[str, str, dict[str, str]]],
    events: list[dict[str, Any]],
    ctx: StepContext,
    unless: list[Any],
    finishes: list[tuple[int, int, Any]],
    raw: int,
) -> dict[str, Any]:
    """A :class:`PendingReport`'s fields but for its numbers."""
    return {
        "run": run,
        "step": step,
        "time": time.time(),
        "rank": rank,
        "emits": emits,
        "flags": flags,
        "events": events,
        "coverage": list(ctx.coverage),
        "unless": [(u.signal, u.reason, u.detail) for u in unless],
        "final": frozenset(ctx.final) | frozenset(ctx.verdicts()),
        "settled": ctx.coverage_settled,
        "finishes": finishes,
        "raw": raw,
        "warns": [(w.warnings, w.values.numel(), w.positive_from, w.warn) for w in ctx.warns],
    }


def _sections(ctx: StepContext) -> list[tuple[tuple[int, int, int], list[int], Any, Any]]:
    """Each section's place in the report (its emit index; the flagged events and
    verdicts before it, which alone are packed), its parts' sizes, its function and the
    signal that added it."""
    out = []
    for sec in ctx.sections:
        emit_at, event_at, unless_at = sec.at
        flags = sum(1 for ev in ctx.events[:event_at] if ev.flag is not None)
        verdicts = sum(1 for u in ctx.unless[:unless_at] if u.flag is not None)
        out.append(((emit_at, flags, verdicts), [p.numel() for p in sec.parts], sec.run, sec.owner))
    return out


def _by_dtype(parts: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[tuple[int, int, int]]] | None:
    """On a CPU, parts of several dtypes concatenated per dtype (a concatenation that
    converts takes a slow path: 25 us for 40 small parts, against 3 us per dtype), with
    (group, start, count) per part for the sender thread to put back in order; None when
    there is one dtype (one concatenation, converted after) or a part is not on the CPU."""
    groups: dict[torch.dtype, tuple[int, list[torch.Tensor], list[int]]] = {}  # index, parts, [size]
    order: list[tuple[int, int, int]] = []
    for p in parts:
        if not p.is_cpu:
            return None
        group = groups.get(p.dtype)
        if group is None:
            group = groups[p.dtype] = (len(groups), [], [0])
        index, members, size = group
        n = p.numel()
        order.append((index, size[0], n))
        members.append(p)
        size[0] += n
    if len(groups) == 1:
        return None
    return [torch.cat(members) for _, members, _ in groups.values()], order
