"""Drift over a run's whole life: the first reference of each 1D parameter, kept durably.

The hooks report ``param_drift_log2 = log2(absmax / absmax at attach)`` next to
``param_absmax``. A job resumed from its checkpoints without the monitor's own state
(``Monitor.state_dict()``; every ``trainvitals run`` job) attaches afresh: its
references are the resumed values and each segment's drift starts at 0, so three
segments of 0.6 bit each (1.8 bits in all) never pass ParamDrift's 1 bit.

The collector sees every segment of a run (the run's name is its identity). From the
first report that carries a parameter's drift it keeps that segment's reference,
``absmax / 2**drift`` (exactly the value at attach), per (run, rank, parameter), in
its state file. A later report whose own reference differs (a resumed segment) has
its ``param_drift_log2`` replaced, before the store and the rules see it, by the
drift since the first reference: ``log2(absmax / first reference)``. ParamDrift and
``/metrics`` then judge the run's lifetime. A job that saves and restores the
monitor's state keeps its original references and reads the same either way.

What it does not catch: a run renamed between segments (a new run to the collector;
``trainvitals run`` names a run after the script and the start time unless ``--run``
or ``TRAINVITALS_RUN`` is given), and references older than ``KEEP_SECONDS`` unseen.
A parameter whose reference is 0 or not finite is left as the hooks report it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

__all__ = ["KEEP_SECONDS", "LifetimeDrift"]

log = logging.getLogger(__name__)

KEEP_SECONDS = 30 * 86400.0
"""A run's references are forgotten after this long without a report of it."""

_TOUCH_SECONDS = 60.0  # a run's last-seen time is written at most this often
_SAME = 1e-6  # bits: a segment reference within this of the first one is the first one

Key = tuple[str, int, str]  # (run, rank, param)


class LifetimeDrift:
    """The first drift reference per (run, rank, parameter); see the module docstring.
    ``state``: the collector's :class:`~trainvitals.monitor.state_db.StateDB` (None: in
    memory only). Thread-safe."""

    def __init__(self, state: Any = None) -> None:
        self._state = state
        self._lock = threading.Lock()
        self._refs: dict[Key, float] = {}
        self._touched: dict[str, float] = {}  # run -> when its "seen" was last written
        if state is not None:
            for run, rank, param, ref in state.load_drift_refs(time.time() - KEEP_SECONDS):
                self._refs[(run, rank, param)] = ref

    def reference(self, run: str, param: str, rank: int = 0) -> float | None:
        """The first reference kept for a parameter, or None."""
        with self._lock:
            return self._refs.get((run, rank, param))

    def apply(self, batch: Any, now: float | None = None) -> int:
        """Rewrite, in place, the ``param_drift_log2`` samples of resumed segments to the
        drift since the run's first reference; keep the first references of parameters
        seen for the first time. ``batch``: the ingest route's decoded ``WireBatch``
        (mutable structs). Returns the samples rewritten."""
        now = time.time() if now is None else now
        fresh: list[tuple[str, int, str, float, float]] = []
        seen: set[str] = set()
        rewritten = 0
        with self._lock:
            for report in batch.reports:
                drifts = [s for s in report.samples if s.name == "param_drift_log2"]
                if not drifts:
                    continue
                if now - self._touched.get(report.run, -math.inf) >= _TOUCH_SECONDS:
                    self._touched[report.run] = now
                    seen.add(report.run)
                absmax = {s.labels.get("param"): s.value for s in report.samples if s.name == "param_absmax"}
                for s in drifts:
                    param = s.labels.get("param")
                    top = absmax.get(param)
                    if param is None or top is None or not (math.isfinite(s.value) and math.isfinite(top)) or top <= 0:
                        continue
                    ref = top / 2.0**s.value
                    if not (math.isfinite(ref) and ref > 0):
                        continue
                    key = (report.run, report.rank, param)
                    first = self._refs.get(key)
                    if first is None:
                        self._refs[key] = ref
                        fresh.append((*key, ref, now))
                    elif abs(math.log2(ref / first)) > _SAME:
                        s.value = math.log2(top / first)
                        rewritten += 1
        if self._state is not None and (fresh or seen):
            self._state.save_drift_refs(fresh, seen, now)
        return rewritten
