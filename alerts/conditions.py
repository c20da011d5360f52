"""``and`` conditions of threshold rules: reading another metric's series of the same run.

A condition reads the series of its metric whose labels equal the primary
series' labels restricted to the labels that metric has (same run and rank),
from the latest report that carried that metric: ``param_drift_log2{param="s"}``
pairs with ``param_weight_decay{param="s"}``, and a condition on a metric without
labels (``loss_weight_mass``) reads the run's one series of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from trainvitals.alerts.model import Condition
from trainvitals.alerts.state import LabelItems

__all__ = ["LabelPredicate", "LatestSamples"]

LabelPredicate = Callable[[Mapping[str, str]], bool]
"""Compiled label matchers of a rule or condition (see ``Matcher.compile``)."""


class _Latest:
    """The samples of one metric from the latest report that carried it (one run/rank),
    indexed by label names: ``{label names: {label items: value}}``.

    A compact copy, built as the report arrives: keeping the report's own sample
    objects (and their label dicts) alive until the run's next report doubled the
    collector's cost per sample (every decode then allocated in cold memory).
    """

    __slots__ = ("_index",)

    def __init__(self, samples: list[Any]) -> None:
        index: dict[tuple[str, ...], dict[LabelItems, float]] = {}
        for sample in samples:
            labels = sample.labels
            items = tuple(labels.items()) if len(labels) < 2 else tuple(sorted(labels.items()))
            names = tuple([k for k, _ in items])
            values = index.get(names)
            if values is None:
                values = index[names] = {}
            values[items] = sample.value
        self._index = index

    def index(self) -> dict[tuple[str, ...], dict[LabelItems, float]]:
        return self._index


class LatestSamples:
    """What ``and`` conditions read: per (run, rank, metric), the latest report's samples."""

    def __init__(self) -> None:
        self._latest: dict[tuple[str, int, str], _Latest] = {}

    def remember(self, run: str, rank: int, metric: str, samples: list[Any]) -> None:
        """The samples of ``metric`` in the report just received (replacing the previous)."""
        self._latest[(run, rank, metric)] = _Latest(samples)

    def seen_all(self, conditions: Iterable[tuple[Condition, LabelPredicate | None]], run: str, rank: int) -> bool:
        """True when every condition's metric was reported by (run, rank)."""
        latest = self._latest
        return all((run, rank, cond.metric) in latest for cond, _ in conditions)

    def verdict(
        self,
        conditions: Iterable[tuple[Condition, LabelPredicate | None]],
        run: str,
        rank: int,
        labels: Mapping[str, str],
    ) -> bool | None:
        """True when every condition holds for the series ``labels`` of (run, rank).

        False as soon as one is clearly false (wins over missing evidence); None
        when none is false but one has no evidence (its series not yet seen, NaN).
        """
        unknown = False
        for cond, match in conditions:
            latest = self._latest.get((run, rank, cond.metric))
            verdict: bool | None = None
            if latest is not None:
                for keys, values in latest.index().items():
                    if not all(k in labels for k in keys):
                        continue
                    items = tuple([(k, labels[k]) for k in keys])
                    value = values.get(items)
                    if value is None or (match is not None and not match(dict(items))):
                        continue
                    holds = cond.holds(value)
                    if holds:
                        verdict = True
                        break
                    if holds is False and verdict is None:
                        verdict = False
            if verdict is False:
                return False
            if verdict is None:
                unknown = True
        return None if unknown else True

    def forget_run(self, run: str) -> None:
        """Drop every series of ``run``."""
        for key in [k for k in self._latest if k[0] == run]:
            del self._latest[key]
