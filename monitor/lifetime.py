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
``a0`` and scale ``s0`` per (run, rank, parameter), in its state file. Beside each
``param_drift_log2`` sample, which is stored and exported as sent, it adds a
``param_drift_lifetime_log2`` sample (a series of its own, same labels): the segment's
figure, and for a later report whose reference differs (a resumed segment) at least

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
flip of the largest element): those need the monitor's own state. A sample whose
reference is not usable (zero, not finite) gets no lifetime figure.

The collector's rules judge the lifetime figure: :func:`judged` gives the alert
engine (and the pages) a view of a report in which ``param_drift_log2`` reads the
lifetime figure; the stored and exported ``param_drift_log2`` stays the job's.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

__all__ = ["DRIFT", "KEEP_SECONDS", "LIFETIME", "LifetimeDrift", "judged", "judged_batch", "judging"]

DRIFT = "param_drift_log2"
"""The drift figure as the hooks send it (since the monitor's own reference)."""
LIFETIME = "param_drift_lifetime_log2"
"""The collector's figure of it over the run's whole life (a separate series)."""

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
        """Add a ``param_drift_lifetime_log2`` sample after the last sample of each report
        for each of its ``param_drift_log2`` samples with a usable reference: the drift
        since the run's first reference (the segment's own figure, raised to the lower
        bound of the drift since the first reference for a resumed segment). Keep the
        first references of parameters seen for the first time. ``batch``: the ingest
        route's decoded ``WireBatch`` (mutable structs); the samples as sent are not
        changed. Returns the lifetime figures above the segment's own."""
        now = time.time() if now is None else now
        fresh: list[tuple[str, int, str, float, float, float]] = []
        seen: set[str] = set()
        rewritten = 0
        with self._lock:
            for report in batch.reports:
                drifts = [s for s in report.samples if s.name == DRIFT]
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
                lifetimes = []
                for s in drifts:
                    param = s.labels.get("param")
                    top, ref, scale = absmax.get(param), refs.get(param), scales.get(param)
                    if param is None or top is None or ref is None or scale is None:
                        continue
                    if not all(math.isfinite(v) for v in (s.value, top, ref, scale)) or ref <= 0 or scale <= 0:
                        continue  # a zero (not yet set) or broken reference: as the hooks report it
                    key = (report.run, report.rank, param)
                    first = self._refs.get(key)
                    value = s.value
                    if first is None:
                        self._refs[key] = (ref, scale)
                        fresh.append((*key, ref, scale, now))
                    elif abs(ref - first[0]) > _SAME * first[0] or abs(scale - first[1]) > _SAME * first[1]:
                        bound = math.log2(1 + abs(top - first[0]) / first[1])
                        if bound > value:
                            value = bound
                            rewritten += 1
                    lifetimes.append(msgspec.structs.replace(s, name=LIFETIME, value=value))
                if lifetimes:  # last, so that judged() finds them at once
                    report.samples = [*report.samples, *lifetimes]
        if self._state is not None and (fresh or seen):
            self._state.save_drift_refs(fresh, seen, now)
        return rewritten


def judged(report: Any) -> Any:
    """``report`` as the collector's rules judge it: its ``param_drift_log2`` samples
    read the lifetime figures :meth:`LifetimeDrift.apply` added (the report itself is
    not changed; one without them is returned as it is)."""
    samples = report.samples
    if not samples or samples[-1].name != LIFETIME:
        return report
    life = {s.labels.get("param"): s.value for s in samples if s.name == LIFETIME}
    out = []
    for s in samples:
        value = life.get(s.labels.get("param")) if s.name == DRIFT else None
        out.append(s if value is None or value == s.value else msgspec.structs.replace(s, value=value))
    return msgspec.structs.replace(report, samples=out)


class _Judged:
    """A batch's reports as :func:`judged` gives them (the ``reports`` an ingest
    callback reads)."""

    __slots__ = ("reports",)

    def __init__(self, reports: list[Any]) -> None:
        self.reports = reports


def judged_batch(batch: Any) -> Any:
    """``batch`` with each report as :func:`judged` gives it (the batch itself when no
    report carries a lifetime figure)."""
    reports = [judged(r) for r in batch.reports]
    if all(a is b for a, b in zip(reports, batch.reports, strict=True)):
        return batch
    return _Judged(reports)


def judging(observe: Callable[[Any, float | None], object]) -> Callable[[Any, float | None], None]:
    """An ingest callback (the store's ``on_ingest``) handing ``observe`` each batch as
    the rules judge it (:func:`judged_batch`); the store keeps the figures as sent."""

    def callback(batch: Any, now: float | None = None) -> None:
        observe(judged_batch(batch), now)

    return callback
