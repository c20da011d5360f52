"""What one report step collects: final values, cross-rank partials, events.

Signals write into a :class:`StepContext` in ``collect``; nothing here reads a
tensor's value on the host. :mod:`trainvitals.hooks.distributed` runs the
cross-rank partials in one collective, then :mod:`trainvitals.hooks.pack` turns
the context into one vector and one host copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:  # pragma: no cover
    from trainvitals.hooks.grad_norms import GradNorms

__all__ = ["HostFinish", "HostSection", "Labels", "ReduceOp", "StepContext"]

Labels = dict[str, str]
ReduceOp = Literal["sum", "max", "min"]


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 1-D tensor outside autograd, with as few ops as it takes (the report
    path makes dozens of these: each op is a few microseconds)."""
    if t.requires_grad:
        t = t.detach()
    return t if t.dim() == 1 else t.reshape(-1)


def _one(t: torch.Tensor) -> torch.Tensor:
    """``t`` (one element) as a 1-element 1-D tensor outside autograd; no op when it is one."""
    if t.dim() == 1 and not t.requires_grad:
        return t
    return t.detach().reshape(1)


HostFinish = Callable[[list[float]], list[float]]
"""Turns an emit's values, as host floats, into one value per labels entry (see
:meth:`StepContext.emit_block`)."""


@dataclass(slots=True)  # made by the dozen per report: cheaper to build and read
class _Emit:
    name: str
    values: torch.Tensor  # 1-D, one element per labels entry (or what ``host`` takes)
    labels: list[Labels]  # of a block: empty (its series hold them)
    present: torch.Tensor | None = None  # 1-D like values (or like gated): a sample is sent only where > 0
    series: list[tuple[str, Sequence[Labels]]] | None = None  # a block (emit_block): (name, labels) end to end
    gated: list[int] | None = None  # a block: the elements ``present`` is for (None: all of them)
    host: HostFinish | None = None  # applied on the sender thread to the values as floats
    count: int = 0  # the samples (labels entries) it makes

    def __post_init__(self) -> None:
        if self.series is None:
            self.count = len(self.labels)


HostSection = Callable[["StepContext", list[torch.Tensor]], None]
"""Writes into a context of its own, on the sender thread, from host copies of its
parts (see :meth:`StepContext.on_host`)."""


@dataclass(slots=True)
class _Section:
    parts: list[torch.Tensor]  # 1-D, copied to the host with the report's values
    run: HostSection
    # len(emits), len(events), len(unless) when it was added: where its samples, events
    # and coverage verdicts go in the report (its warnings are said when it runs)
    at: tuple[int, int, int]
    owner: Any = None  # the signal whose collect added it (set by the step lifecycle)


@dataclass(slots=True)
class _Reduce:
    tensor: torch.Tensor  # 1-D float
    op: ReduceOp
    then: Callable[[torch.Tensor], None]
    owner: Any = None  # the signal whose collect added it (set by the step lifecycle)


@dataclass(slots=True)
class _Warn:
    warnings: tuple[tuple[str, str], ...]  # (key, message with one %d)
    values: torch.Tensor  # 1-D: a count per warning, or flags counted from positive_from
    positive_from: int | None
    warn: Callable[..., Any]  # warn(key, message, count): the monitor's log-once


@dataclass(slots=True)
class _Event:
    kind: str
    detail: str
    labels: Labels
    flag: torch.Tensor | None  # None: always; else emitted when the flag is > 0 on the host


@dataclass(slots=True)
class _Unless:
    signal: str
    flag: torch.Tensor | None  # 1 element: the entry is inactive when it is > 0 on the host; None: always
    reason: str
    detail: str


@dataclass
class StepContext:
    """What one report step collects: final values, cross-rank partials, events."""

    step: int
    device: torch.device
    emits: list[_Emit] = field(default_factory=list)
    reduces: list[_Reduce] = field(default_factory=list)
    events: list[_Event] = field(default_factory=list)
    coverage: list[dict[str, Any]] = field(default_factory=list)
    """The report's coverage entries (the monitor writes them after the signals' collect)."""
    final: set[str] = field(default_factory=set)
    """Signals whose entry no verdict of this report changes (failed, declared inactive)."""
    coverage_settled: bool = False
    """The coverage was judged already, against the figures of the report it was taken
    from (the run_end report carries the last report's as sent): not judged again against
    this report's samples (:func:`trainvitals.hooks.coverage.without_figures`)."""
    unless: list[_Unless] = field(default_factory=list)
    warns: list[_Warn] = field(default_factory=list)
    sections: list[_Section] = field(default_factory=list)
    grad_norms: GradNorms | None = None
    """The step's gradient norms (:mod:`trainvitals.hooks.grad_norms`), taken once before
    ``optimizer.step()`` when a running signal uses them; None otherwise."""

    def inactive_when(self, signal: str, flag: torch.Tensor | None, reason: str, detail: str = "") -> None:
        """Make ``signal``'s coverage entry inactive for ``reason`` in this report: always
        (``flag`` None), or when ``flag`` (a 0-d tensor) is > 0, decided on the sender
        thread (no host sync). The first verdict of a signal that holds wins (the order:
        :mod:`trainvitals.hooks.coverage`)."""
        from trainvitals.wire.coverage import REASONS, SIGNALS

        if signal not in SIGNALS or reason not in REASONS:
            raise ValueError(f"inactive_when: unknown signal {signal!r} or reason {reason!r}")
        self.unless.append(_Unless(signal, None if flag is None else _one(flag), reason, detail))

    def verdicts(self) -> dict[str, tuple[str, str]]:
        """The flag-free verdicts, the first per signal."""
        out: dict[str, tuple[str, str]] = {}
        for u in self.unless:
            if u.flag is None:
                out.setdefault(u.signal, (u.reason, u.detail))
        return out

    def emit(
        self,
        name: str,
        values: torch.Tensor,
        labels: Labels | Sequence[Labels] | None = None,
        *,
        present: torch.Tensor | None = None,
    ) -> None:
        """Report ``values`` under wire name ``name``: a 0-d tensor with one labels dict,
        or a 1-D tensor with one labels dict per element. With ``present`` (same shape
        as ``values``), a sample is sent only where it is > 0: a statistic that is
        undefined on this step is absent, decided on the sender thread (no host sync)."""
        if isinstance(labels, dict) or labels is None:
            labels = [labels or {}]
        values = _flat(values)
        if values.numel() != len(labels):
            raise ValueError(f"{name}: {values.numel()} values for {len(labels)} label sets")
        if present is not None:
            present = _flat(present)
            if present.numel() != values.numel():
                raise ValueError(f"{name}: present has {present.numel()} elements for {values.numel()} values")
        if len(labels):
            self.emits.append(_Emit(name, values, list(labels), present))

    def emit_block(
        self,
        series: Sequence[tuple[str, Sequence[Labels]]],
        values: torch.Tensor,
        *,
        present: torch.Tensor | None = None,
        gated: Sequence[int] = (),
        host: HostFinish | None = None,
    ) -> None:
        """Report several series from one 1-D tensor: ``series`` lists (wire name, one
        labels dict per element) in the order their values lie end to end in ``values``.
        The same as one :meth:`emit` per series, without a slice per series. With
        ``present`` (one value per position in ``gated``, positions in ``values``), those
        samples are sent only where it is > 0, decided on the sender thread.

        ``host``: the last elementwise steps of a figure (a division by host-known
        counts, a root, a median of a few numbers) done on the sender thread instead
        of as tensor ops on the training thread (an op there costs 10-20 us of dispatch
        on a CPU, a kernel launch on a GPU). ``values`` is then what ``host`` takes: it
        gets them as Python floats and returns one float per labels entry. It runs on
        another thread, later: it must read only what it was given and what does not
        change (host numbers fixed when it was made)."""
        # The per-sample layout is made on the sender thread (pack keeps the series).
        series = list(series)
        count = sum(len(labs) for _, labs in series)
        values = _flat(values)
        if host is None and values.numel() != count:
            raise ValueError(f"{series[0][0] if series else ''}: {values.numel()} values for {count} label sets")
        if present is not None:
            present = _flat(present)
            if present.numel() != len(gated) or any(not 0 <= i < count for i in gated):
                raise ValueError(f"emit_block: present has {present.numel()} elements for gated {list(gated)}")
        if count:
            self.emits.append(_Emit(series[0][0], values, [], present, series, list(gated), host, count))

    def reduce(
        self, tensor: torch.Tensor, op: ReduceOp, then: Callable[[torch.Tensor], None], *, as_is: bool = False
    ) -> None:
        """Combine ``tensor`` across data-parallel ranks with ``op``, then call ``then``
        with the combined tensor, float32 (at once when there is one rank). All partials
        of a report travel in one packed collective. With ``as_is``, a single rank's
        ``then`` gets ``tensor`` itself, flattened, in its own dtype (no copy: the
        caller must not write it before ``then`` has run)."""
        self.reduces.append(_Reduce(_flat(tensor) if as_is else _flat(tensor).float(), op, then))

    def event(
        self, kind: str, detail: str = "", labels: Labels | None = None, *, when: torch.Tensor | None = None
    ) -> None:
        """Attach an event to this report; with ``when`` (a 0-d tensor), only if it is > 0,
        decided on the sender thread so the step never waits for the value."""
        self.events.append(_Event(kind, detail, labels or {}, None if when is None else _one(when)))

    def warn_when(
        self,
        warnings: Sequence[tuple[str, str]],
        values: torch.Tensor,
        warn: Callable[..., Any],
        *,
        positive_from: int | None = None,
    ) -> None:
        """Log each ``(key, message)`` of ``warnings`` once, as ``warn(key, message,
        count)``, when its count in ``values`` (1-D, one per warning) is > 0, decided on
        the sender thread with the report's values (no host sync, no op). With
        ``positive_from`` (one warning), its count is the number of
        ``values[positive_from:]`` that are > 0."""
        values = _flat(values)
        if positive_from is None and values.numel() != len(warnings):
            raise ValueError(f"warn_when: {values.numel()} counts for {len(warnings)} warnings")
        if positive_from is not None and len(warnings) != 1:
            raise ValueError("warn_when: positive_from counts the flags of one warning")
        self.warns.append(_Warn(tuple(warnings), values, positive_from, warn))

    def emit_rows(
        self,
        names: Sequence[str],
        values: torch.Tensor,
        labels: Sequence[Labels],
        *,
        present: torch.Tensor | None = None,
    ) -> None:
        """``emit(names[i], values[i], labels, present=present[i])`` for each row of
        ``values`` ``[len(names), len(labels)]``, split with one op (the rows of one
        computation need no op each)."""
        if tuple(values.shape) != (len(names), len(labels)):
            raise ValueError(f"emit_rows: values {tuple(values.shape)} for {len(names)} names x {len(labels)} labels")
        if present is not None and present.shape != values.shape:
            raise ValueError(f"emit_rows: present {tuple(present.shape)} for values {tuple(values.shape)}")
        if not labels:
            return
        rows = values.detach().unbind(0) if values.requires_grad else values.unbind(0)
        gates = present.unbind(0) if present is not None else [None] * len(names)
        for name, row, gate in zip(names, rows, gates, strict=True):
            self.emits.append(_Emit(name, row, list(labels), gate))

    def events_when(self, events: Sequence[tuple[str, str, Labels | None]], when: torch.Tensor) -> None:
        """``event(kind, detail, labels, when=when[i])`` for each ``(kind, detail,
        labels)`` of ``events`` and element of the 1-D ``when``, split with one op."""
        if when.numel() != len(events):
            raise ValueError(f"events_when: {when.numel()} flags for {len(events)} events")
        flags = when.detach().view(-1, 1).unbind(0)
        for (kind, detail, labels), flag in zip(events, flags, strict=True):
            self.events.append(_Event(kind, detail, labels or {}, flag))

    def on_host(self, parts: Sequence[torch.Tensor], run: HostSection) -> None:
        """Call ``run(sub, host_parts)`` on the sender thread, when the report is
        materialized: ``host_parts`` are CPU copies of ``parts`` (1-D, in the report's
        host dtype, or their own on a CPU) taken when the report was packed, ``sub`` a
        :class:`StepContext` on the CPU whose emits, events, verdicts and warnings join
        this report where ``on_host`` was called (the same order as if they had been
        written here). The figures worked out from a few host numbers then cost the
        training thread no op at all (an op is 10-20 us of dispatch on a CPU, a kernel
        launch on a GPU). ``run`` must read only ``host_parts`` and what does not change
        after this call: it runs on another thread, a step or more later. It must not
        write into ``host_parts`` (views of the report's host copy; a report whose
        materializing failed after its sections is materialized again from it). A ``run``
        that raises loses only what it wrote: the report says the signal that added it
        failed, and that signal is turned off at its next call on the training thread
        (``Signal.fail_later``); one added outside a signal's ``collect`` drops its
        report instead (the sender logs it once)."""
        if not callable(run):
            raise TypeError(f"on_host: run must be callable, not {type(run).__name__}")
        flat = [_flat(p) for p in parts]
        self.sections.append(_Section(flat, run, (len(self.emits), len(self.events), len(self.unless))))

    def combine(
        self,
        parts: Sequence[tuple[torch.Tensor, ReduceOp]],
        then: Callable[..., None],
        *,
        across_ranks: bool,
        as_is: bool = False,
    ) -> None:
        """Call ``then(*combined)`` once with every part combined across data-parallel
        ranks by its op; with ``across_ranks=False`` (nothing sharded) at once, with the
        parts as they are. ``as_is``: see :meth:`reduce`."""
        if not across_ranks:
            then(*(t for t, _ in parts))
            return
        out: list[torch.Tensor | None] = [None] * len(parts)

        def store(i: int, t: torch.Tensor) -> None:
            out[i] = t
            if all(o is not None for o in out):
                then(*out)

        for i, (t, op) in enumerate(parts):
            self.reduce(t, op, functools.partial(store, i), as_is=as_is)
