"""Live settings: the collector's answer to a report can change a running job's
report interval, built-in signals, per-parameter mode and probe interval, for a
limited time (``trainvitals configure``; docs/wire.md, "Live settings").

Where each part runs:

- the sender thread: :class:`~trainvitals.hooks.sinks.HttpSink` hands every
  accepted batch's answer to :meth:`LiveSettings.receive`, which checks the run's
  entry and stores it, with its deadline, in one attribute (an atomic swap). It
  changes nothing else: a bad entry is logged once and ignored.
- the training thread, at the end of each optimizer step (after its report):
  :meth:`LiveSettings.step_end` applies what is wanted, so the next step runs with
  it. With one process that is the newest answer (or the job's own settings once
  its deadline has passed, so a collector that went away cannot leave ``every=1``
  on for weeks).
- data parallel (a process group of several ranks): only rank 0 sends and hears
  answers, but every rank must report on the same steps (each report is a
  collective). Rank 0's wanted settings ride in each report's one collective (five
  numbers, :meth:`contribute`); every rank applies what one report carried at the
  end of the next report step, the same step everywhere. That reads a copy made a
  whole report interval earlier: no wait on the current step's work.

Nothing here raises into training: a failure is logged once and the job keeps the
settings it has.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from trainvitals.hooks.config import Config
from trainvitals.hooks.running_signals import PendingEvents, RunningSignals
from trainvitals.hooks.signals.base import REBINDING, MonitorView, Signal
from trainvitals.hooks.step import StepContext
from trainvitals.wire.live_settings import BUILTIN_SIGNALS, LIVE_FIELDS, MAX_INTERVAL, parse_entry
from trainvitals.wire.signals import SignalNames

__all__ = ["LIVE_FIELDS", "MAX_EVERY", "LiveSettings", "parse_entry"]

MAX_EVERY = MAX_INTERVAL
"""Largest report or probe interval accepted from the collector (steps); the wire's ``MAX_INTERVAL``."""

log = logging.getLogger("trainvitals")

_OWN = -1.0  # in the collective's vector: "the job's own value"


class LiveSettings:
    """One monitor's live settings: what the collector asked for and what is applied.

    ``own``: the job's settings; ``signals``: the monitor's running signals, which a
    change of ``signals=`` adds to and removes from; ``builtin``: the built-in signal
    classes by name, in the order they run; ``events``: the monitor's queue of events."""

    def __init__(
        self,
        own: Config,
        *,
        run: str,
        signals: RunningSignals,
        events: PendingEvents,
        builtin: dict[str, type[Signal]],
    ) -> None:
        self.own = own
        """The job's own settings (attach's), which an override replaces field by field."""
        self.applied: dict[str, Any] = {}
        """The override in force now (empty: the job's own settings)."""
        self.run = run
        self._signals_running = signals
        self._events = events
        self._builtin = builtin
        self._offer: tuple[dict[str, Any], float] | None = None  # (override, monotonic deadline)
        self._held: tuple[dict[str, Any], float] | None = None  # the offer as the step began its end
        self._warned: set[str] = set()
        self._stash: dict[str, dict[str, Any]] = {}  # state of signals turned off, by name
        # Data parallel: rank 0's wanted state, numbered; what the reports carried.
        self._wanted: dict[str, Any] = {}
        self._version = 0
        self._applied_version = 0
        self._carried: list[tuple[int, torch.Tensor, Any]] = []  # (report step, host copy, event)
        self._cached: tuple[Any, torch.Tensor] | None = None
        self._lock = threading.Lock()  # receive() runs on the sender thread

    # -- the sender thread ---------------------------------------------------------
    def receive(self, answer: Mapping[str, Any]) -> None:
        """Take the collector's answer to an accepted batch. Its ``settings`` entry for
        this run is the whole override (no entry: none, back to the job's own)."""
        settings = answer.get("settings") if isinstance(answer, Mapping) else None
        entry = settings.get(self.run) if isinstance(settings, Mapping) else None
        if entry is None:
            offer = None
        else:
            try:
                override, left = parse_entry(entry)
            except ValueError as exc:
                self._warn("entry", "ignoring the live settings the collector sent for run %r: %s", self.run, exc)
                return
            offer = (override, time.monotonic() + left)
        with self._lock:
            self._offer = offer

    # -- the training thread -------------------------------------------------------
    def wanted(self) -> dict[str, Any]:
        """The override wanted now: the newest answer's, unless its deadline passed."""
        return _in_force(self._offer)

    def step_ending(self) -> None:
        """At the end of an optimizer step, before its report is handed to the sender:
        hold the newest answer for :meth:`step_end`. An answer to this step's own report
        that lands while the step is still ending waits for the next step's end, so an
        answer always applies at the end of the step after the one that carried it,
        however fast the collector answers."""
        self._held = self._offer

    def step_end(self, monitor: MonitorView, reported: bool) -> None:
        """At the end of an optimizer step (after its report): apply what is due."""
        try:
            if monitor.world_size > 1:
                if reported:
                    self._apply_carried(monitor)
                return
            held = self._held
            if held is None and not self.applied:
                return  # the common case: nothing was ever asked
            wanted = _in_force(held)
            if wanted != self.applied:
                self.apply(monitor, wanted)
        except Exception as exc:  # noqa: BLE001 - never into the training loop
            self._warn("apply", "could not apply live settings: %s: %s", type(exc).__name__, exc)

    def contribute(self, monitor: MonitorView, ctx: StepContext) -> None:
        """Data parallel, on every report step of every rank: rank 0's wanted state
        joins the report's collective (the other ranks add zeros, so the sum is rank
        0's); its host copy is read at the end of the next report step."""
        if monitor.world_size <= 1:
            return
        try:
            values = [0.0] * 5
            if monitor.rank == 0:
                wanted = self.wanted()
                if wanted != self._wanted:
                    self._wanted = wanted
                    self._version += 1
                values = encode(self._version, wanted)
            step = ctx.step

            def keep(combined: torch.Tensor) -> None:
                if combined.device.type == "cuda":
                    host = torch.empty(combined.shape, dtype=combined.dtype, pin_memory=True)
                    host.copy_(combined, non_blocking=True)
                    ready = torch.cuda.Event()
                    ready.record()
                else:
                    host, ready = combined.detach().to("cpu", copy=True), None
                self._carried.append((step, host, ready))

            ctx.reduce(self._vector(values, ctx.device), "sum", keep)
        except Exception as exc:  # noqa: BLE001
            self._warn("contribute", "could not share live settings across ranks: %s", exc)

    def _vector(self, values: list[float], device: torch.device) -> torch.Tensor:
        """``values`` on ``device``, made only when they change: filled in place on the
        device (a copy from the host would wait for the device under CUDA)."""
        key = (tuple(values), device)
        if self._cached is None or self._cached[0] != key:
            vec = torch.zeros(len(values), dtype=torch.float32, device=device)
            for i, v in enumerate(values):
                if v:
                    vec[i] = v
            self._cached = (key, vec)
        return self._cached[1]

    def _apply_carried(self, monitor: MonitorView) -> None:
        # The copy of an earlier report step: done long ago, the wait is a formality.
        earlier = [c for c in self._carried if c[0] < monitor.step]
        self._carried = [c for c in self._carried if c[0] >= monitor.step]
        if not earlier:
            return
        _, host, ready = earlier[-1]
        if ready is not None:
            ready.synchronize()
        version, wanted = decode(host.tolist())
        if version != self._applied_version:
            self._applied_version = version
            if wanted != self.applied:
                self.apply(monitor, wanted)

    def apply(self, monitor: MonitorView, override: dict[str, Any]) -> None:
        """Make ``override`` (over the job's own settings) the monitor's settings, from
        the next step on: the interval, the built-in signals (one turned off keeps its
        state for when it comes back), per-parameter series, the probe."""
        old = monitor.config
        new = dataclasses.replace(self.own, **override)
        monitor.config = new
        self._signals(monitor, old, new)
        for s in list(self._signals_running.items):
            if not s.broken:
                s.settings_changed(monitor, old, new)
        self.applied = dict(override)
        if override:
            offer = self._held or self._offer
            left = offer[1] - time.monotonic() if offer is not None else float("nan")
            log.info(
                "trainvitals: run %r: live settings from the collector from step %d: %s "
                "(the job's own: %s); back to the job's own in %.0f s",
                self.run,
                monitor.step + 1,
                _show(override),
                _show({k: getattr(self.own, k) for k in override}),
                left,
            )
        else:
            log.info(
                "trainvitals: run %r: back to the job's own settings from step %d (%s)",
                self.run,
                monitor.step + 1,
                _show({k: getattr(self.own, k) for k in LIVE_FIELDS}),
            )

    # -- internals -----------------------------------------------------------------
    def _signals(self, monitor: MonitorView, old: Config, new: Config) -> None:
        classes = self._builtin
        want = set(BUILTIN_SIGNALS if new.signals is None else new.signals)
        # Per-parameter series are chosen when these signals bind: rebuild them.
        rebuild = set(SignalNames(lambda s: s.per_param_series)) if old.per_param != new.per_param else set()
        for name in BUILTIN_SIGNALS:
            cls = classes.get(name)
            if cls is None:
                continue  # declared (a spec) but no class registered on this side
            current = next((s for s in self._signals_running.items if type(s) is cls), None)
            if current is not None and current.broken:
                continue  # failed once: stays off
            if current is not None and (name not in want or name in rebuild):
                self._remove(name, current)
                current = None
            if current is None and name in want:
                self._add(monitor, name, cls())

    def _remove(self, name: str, signal: Signal) -> None:
        state = signal.run_guarded("state_dict", signal.state_dict)
        if state:
            self._stash[name] = state
        signal.run_guarded("close", signal.close)
        self._signals_running.unbind(signal)

    def _add(self, monitor: MonitorView, name: str, signal: Signal) -> None:
        # Built-in signals keep the order they have at attach (cheap bookkeeping order).
        order: dict[type[Signal], int] = {cls: i for i, cls in enumerate(self._builtin.values())}
        rank = order.get(type(signal), len(order))
        running = self._signals_running.items
        at = next((i for i, s in enumerate(running) if order.get(type(s), len(order)) > rank), len(running))
        events = self._events.mark()
        token = REBINDING.set(True)  # the change logs one line (apply); the start-up lines are not repeated
        try:
            self._signals_running.bind(signal, monitor, at)
            # Binding again repeats the one-off weight-decay audit: it was reported at attach.
            self._events.drop_since(events)
            saved = self._stash.pop(name, None)
            if saved:
                signal.run_guarded("load_state_dict", signal.load_state_dict, saved)
        finally:
            REBINDING.reset(token)

    def _warn(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("trainvitals: " + message, *args)


def _in_force(offer: tuple[dict[str, Any], float] | None) -> dict[str, Any]:
    """An offer's override, or none once its deadline has passed."""
    if offer is None or time.monotonic() >= offer[1]:
        return {}
    return offer[0]


def encode(version: int, override: Mapping[str, Any]) -> list[float]:
    """The five numbers one report's collective carries: version, every (0: own),
    per_param (-1 own, 0, 1), probe_every (-1 own, 0 off, N), signals (-1 own, else a
    bit per built-in signal). Exact in float32: all are small integers."""
    signals = override.get("signals", "own")
    mask = (
        _OWN
        if signals == "own"
        else float(-2 if signals is None else sum(1 << i for i, s in enumerate(BUILTIN_SIGNALS) if s in signals))
    )
    probe = override.get("probe_every", "own")
    return [
        float(version),
        float(override.get("every", 0)),
        _OWN if "per_param" not in override else float(override["per_param"]),
        _OWN if probe == "own" else float(probe or 0),
        mask,
    ]


def decode(values: list[float]) -> tuple[int, dict[str, Any]]:
    """Inverse of :func:`encode`."""
    version, every, per_param, probe, mask = (round(v) for v in values)
    out: dict[str, Any] = {}
    if every > 0:
        out["every"] = every
    if per_param >= 0:
        out["per_param"] = bool(per_param)
    if probe >= 0:
        out["probe_every"] = probe or None
    if mask == -2:
        out["signals"] = None
    elif mask >= 0:
        out["signals"] = tuple(s for i, s in enumerate(BUILTIN_SIGNALS) if mask >> i & 1)
    return version, out


def _show(values: Mapping[str, Any]) -> str:
    def one(k: str, v: Any) -> str:
        if k == "signals":
            return "all" if v is None else (",".join(v) or "none")
        if k == "probe_every" and v is None:
            return "off"
        return str(v)

    return ", ".join(f"{k}={one(k, v)}" for k, v in values.items())
