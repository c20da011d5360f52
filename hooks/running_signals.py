"""The signals one monitor runs, the hooks they placed, and the events queued for the
next report.

The list is the order signals run in (the order of their cheap per-step bookkeeping
and of their figures in a report). A signal joins with :meth:`RunningSignals.bind` (its
hooks kept with it) and leaves with :meth:`RunningSignals.unbind` (its hooks
removed); :meth:`RunningSignals.close` removes every hook the monitor placed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar

from trainvitals.hooks.coverage import CoverageTracker
from trainvitals.hooks.signals.base import MonitorView, Removable, Signal
from trainvitals.hooks.step import StepContext

__all__ = ["PendingEvents", "RunningSignals"]

S = TypeVar("S", bound=Signal)


class PendingEvents:
    """Host-side events (``monitor.event``) waiting for the next report."""

    def __init__(self) -> None:
        self._items: list[tuple[str, str, dict[str, str]]] = []

    def add(self, kind: str, detail: str = "", labels: dict[str, str] | None = None) -> None:
        self._items.append((kind, detail, dict(labels or {})))

    def mark(self) -> int:
        """A point in the queue, for :meth:`drop_since`."""
        return len(self._items)

    def drop_since(self, mark: int) -> None:
        """Forget the events queued after ``mark``."""
        del self._items[mark:]

    def move_to(self, ctx: StepContext) -> None:
        """Put every queued event on ``ctx`` (a report), emptying the queue."""
        for kind, detail, labels in self._items:
            ctx.event(kind, detail, labels)
        self._items.clear()


class RunningSignals:
    """The running signals in order (:attr:`items`) and every hook placed for them."""

    def __init__(self, signals: list[Signal]) -> None:
        self.items = signals
        """The running signals, in the order they run (the monitor's ``signals``)."""
        self._handles: list[Removable] = []
        self._own: dict[int, list[Removable]] = {}  # id(signal) -> the hooks its bind placed

    def __iter__(self) -> Iterator[Signal]:
        return iter(self.items)

    def hold(self, handle: Removable) -> None:
        """Keep a hook placed for the signals as a whole (removed at :meth:`close`)."""
        self._handles.append(handle)

    def hold_all(self, handles: list[Removable]) -> None:
        self._handles.extend(handles)

    def bind(self, signal: Signal, monitor: MonitorView, at: int | None = None) -> None:
        """``signal`` places its hooks and runs from now on, at position ``at`` (default:
        last; already listed: where it is)."""
        handles = list(signal.run_guarded("bind", signal.bind, monitor) or [])
        self._own[id(signal)] = handles
        self._handles.extend(handles)
        if signal not in self.items:
            self.items.insert(len(self.items) if at is None else at, signal)

    def unbind(self, signal: Signal) -> None:
        """``signal`` stops: its hooks removed, it leaves the list (not closed here)."""
        for h in self._own.pop(id(signal), []):
            h.remove()
            if h in self._handles:
                self._handles.remove(h)
        self.items.remove(signal)

    def find(self, cls: type[S]) -> S | None:
        """The running signal of class ``cls`` (or a subclass), or None."""
        for s in self.items:
            if isinstance(s, cls):
                return s
        return None

    def state_dict(self) -> dict[str, Any]:
        """Each working signal's state, by class name."""
        return {type(s).__name__: s.state_dict() for s in self.items if not s.broken}

    def restore(self, signal: Signal, saved: dict[str, Any]) -> None:
        """Give ``signal`` its part of a saved state (taken out of ``saved``), if any."""
        state = saved.pop(type(signal).__name__, None)
        if state:
            signal.run_guarded("load_state_dict", signal.load_state_dict, state)

    def coverage_entries(
        self,
        coverage: CoverageTracker,
        emitted: dict[str, bool],
        *,
        stepped: bool,
        verdicts: dict[str, tuple[str, str]] | None = None,
    ) -> tuple[list[dict[str, Any]], set[str]]:
        """The coverage entries of a report (and the final ones): ``emitted`` says, per
        running signal, whether it emitted samples in this report (absent: judged as
        emitting, for previews); ``stepped``: an optimizer step has run; ``verdicts``:
        the report's own (``ctx.inactive_when``)."""
        running: dict[str, tuple[bool, bool, str]] = {}
        for s in self.items:
            if s.covers is not None:
                running[s.covers] = (emitted.get(s.covers, True), s.broken, s.failure)
        return coverage.entries(running, stepped=stepped, verdicts=verdicts)

    def close(self) -> None:
        """Remove every hook placed, then close every signal."""
        for h in self._handles:
            try:
                h.remove()
            except Exception:  # noqa: BLE001 - a handle that is already gone is fine
                pass
        self._handles.clear()
        self._own.clear()
        for s in self.items:
            s.run_guarded("close", s.close)
