"""Drift over a run's whole life: the first reference of each 1D parameter, kept durably.

The hooks report ``param_drift_log2 = log2(1 + max|x - x_ref| / scale)``, with
``param_drift_reference_absmax`` (absmax of ``x_ref``, the value at attach) and
``param_drift_scale`` (the scale divided by) beside it. A job resumed from its
checkpoints without the monitor's own state (``Monitor.state_dict()``; every
``trainvitals run`` job) attaches afresh: its references are the resumed values and
each segment's drift starts at 0, so three segments of 0.6 bit each never pass
ParamDrift's 1 bit.

The collector sees every segment of a run (the run's name is its identity). From the
first report that carries a parameter's reference it keeps that reference's absmax
``a0`` and scale ``s0`` per (run, rank, parameter), in its state file. A later report
whose reference differs (a resumed segment) has its ``param_drift_log2`` raised,
before the store and the rules see it, to at least

    log2(1 + |absmax(x) - a0| / s0)

a lower bound of the drift since the first reference (``| max|x| - max|x_ref| | <=
max|x - x_ref|``), exact for a scalar that walks away from zero (I4's norm scale, 1.0
-> 56) and for any parameter whose largest element moves the most. The segment's own
figure is kept when it is larger. A job that saves and restores the monitor's state
keeps its original references and reads the same either way.

What it does not catch: a run renamed between segments (a new run to the collector;
``trainvitals run`` names a run after the script and the start time unless ``--run``
or ``TRAINVITALS_RUN`` is given), references older than ``KEEP_SECONDS`` unseen, and
drift that leaves a vector's absmax where it was (elements trading places, a sign
flip of the largest element): those need the monitor's own state.
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
_SAME = 1e-6  # relative: a segment reference within this of the first one is the first one

Key = tuple[str, int, str]  # (run, rank, param)
Ref = tuple[float, float]  # (absmax of the first reference, the scale judged against)


class LifetimeDrift:
    """The first drift reference per (run, rank, parameter); see the module docstring.
    ``state``: the collector's :class:`~trainvitals.monitor.state_db.StateDB` (None: in
    memory only). Thread-safe."""

    def __init__(self, state: Any = None) -> None:
        self._state = state
        self._lock = threading.Lock()
        self._refs: dict[Key, Ref] = {}
        self._touched: dict[str, float] = {}  # run -> when its "seen" was last written
        if state is not None:
            for run, rank, param, ref, scale in state.load_drift_refs(time.time() - KEEP_SECONDS):
                self._refs[(run, rank, param)] = (ref, scale)

    def reference(self, run: str, param: str, rank: int = 0) -> float | None:
        """The absmax of the first reference kept for a parameter, or None."""
        with self._lock:
            kept = self._refs.get((run, rank, param))
        return None if kept is None else kept[0]

    def apply(self, batch: Any, now: float | None = None) -> int:
        """Raise, in place, the ``param_drift_log2`` samples of resumed segments to the
        lower bound of the drift since the run's first reference; keep the first
        references of parameters seen for the first time. ``batch``: the ingest route's
        decoded ``WireBatch`` (mutable structs). Returns the samples raised."""
        now = time.time() if now is None else now
        fresh: list[tuple[str, int, str, float, float, float]] = []
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
                by_name: dict[str, dict[Any, float]] = {
                    "param_absmax": {},
                    "param_drift_reference_absmax": {},
                    "param_drift_scale": {},
                }
                for s in report.samples:
                    if s.name in by_name:
                        by_name[s.name][s.labels.get("param")] = s.value
                absmax, refs, scales = by_name.values()
                for s in drifts:
                    param = s.labels.get("param")
                    top, ref, scale = absmax.get(param), refs.get(param), scales.get(param)
                    if param is None or top is None or ref is None or scale is None:
                        continue
                    if not all(math.isfinite(v) for v in (s.value, top, ref, scale)) or ref <= 0 or scale <= 0:
                        continue  # a zero (not yet set) or broken reference: as the hooks report it
                    key = (report.run, report.rank, param)
                    first = self._refs.get(key)
                    if first is None:
                        self._refs[key] = (ref, scale)
                        fresh.append((*key, ref, scale, now))
                    elif abs(ref - first[0]) > _SAME * first[0] or abs(scale - first[1]) > _SAME * first[1]:
                        bound = math.log2(1 + abs(top - first[0]) / first[1])
                        if bound > s.value:
                            s.value = bound
                            rewritten += 1
        if self._state is not None and (fresh or seen):
            self._state.save_drift_refs(fresh, seen, now)
        return rewritten
