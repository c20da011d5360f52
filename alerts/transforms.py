"""Value transforms of threshold rules, and the per-series history they need.

- ``value``: the sample as reported.
- ``increase`` (counters): the increase since the series' previous report; a
  decrease is a counter reset (a restarted job), so the new value is the
  increase. The first report is the baseline: no value yet.
- ``ratio_to_median``: the value over the median of the series' previous
  ``window`` finite values (a spike factor, unitless). No value until
  ``min_history`` reports are in (default ``window``); with a median at or below
  0, a positive value gives +Inf and any other no value.

"No value" (None) is no evidence: the engine keeps the alert's state. NaN is
never remembered, so one NaN does not poison the baseline.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Hashable
from typing import Any

from trainvitals.alerts.model import ThresholdRule

__all__ = ["SeriesHistory"]


class SeriesHistory:
    """What ``increase``/``ratio_to_median`` remember per series.

    Keys are the engine's (rule index, run, rank, label items); the run is the
    second element, so :meth:`forget_run` can drop a run's history.
    """

    def __init__(self) -> None:
        # key -> last value (increase) | deque of recent values (ratio_to_median)
        self._history: dict[tuple[Any, ...], Any] = {}

    def apply(self, rule: ThresholdRule, key: tuple[Hashable, ...], raw: float) -> float | None:
        """The rule's transform of ``raw`` for this series; None while there is no value."""
        if rule.transform == "value":
            return raw
        if rule.transform == "increase":
            prev = self._history.get(key)
            if raw == raw:
                self._history[key] = raw
            if prev is None or raw != raw:
                return None
            return raw if raw < prev else raw - prev  # a decrease is a counter reset
        med = self.median_step(rule, key, raw)
        if med is None:
            return None
        if med > 0:
            return raw / med
        if raw == raw:
            return math.inf if raw > 0 else None
        return None

    def median_step(self, rule: ThresholdRule, key: tuple[Hashable, ...], raw: float) -> float | None:
        """``ratio_to_median``'s step on one value: the median ``raw`` is divided by (None
        while the history is shorter than ``min_history``), then ``raw`` is remembered.
        :meth:`apply` uses it; so does the report page, to draw the rule's threshold in
        the metric's own unit (``above`` times this median)."""
        hist = self._history.get(key)
        if hist is None:
            hist = self._history[key] = deque(maxlen=rule.window)
        med = statistics.median(hist) if len(hist) >= rule.history_needed else None
        if math.isfinite(raw):
            hist.append(raw)
        return med

    def forget_run(self, run: str) -> None:
        """Drop every series of ``run``."""
        for key in [k for k in self._history if k[1] == run]:
            del self._history[key]
