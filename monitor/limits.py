"""The store's limits: series budgets (a cap per collector, a budget per run) and the
metric-name clash check, each refusing a batch whole before anything changes.

:class:`~trainvitals.monitor.store.SeriesStore` calls :func:`check_budgets` and
:class:`NameRegistry` under its lock; the refusals carry their HTTP answer
(:class:`~trainvitals.wire.errors.Refused`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import attrgetter
from typing import Any

from trainvitals.monitor.lifetime import LIFETIME
from trainvitals.monitor.series import LabelKey, RunSeries, label_key
from trainvitals.wire import PREFIX, RESERVED_NAMES, ends_run, exposed_family
from trainvitals.wire.coverage import coverage_samples
from trainvitals.wire.errors import Refused

__all__ = [
    "DEFAULT_MAX_SERIES",
    "FULL_RETRY_AFTER",
    "IngestRefused",
    "NameRegistry",
    "RunSeriesLimitExceeded",
    "SeriesLimitExceeded",
    "check_budgets",
]

DEFAULT_MAX_SERIES = 1_000_000

FULL_RETRY_AFTER = 30
"""Seconds a client should wait before retrying when the collector is full."""


class IngestRefused(Refused, ValueError):
    """A batch the store will not apply; nothing was changed (422)."""


class SeriesLimitExceeded(IngestRefused):
    """Applying the batch would take the store past its series cap (the collector is full):
    503, the client keeps the reports and retries after ``Retry-After`` seconds."""

    status = 503
    outcome = "series_limit"

    def __init__(self, detail: str) -> None:
        super().__init__(detail, headers={"Retry-After": str(FULL_RETRY_AFTER)})


class RunSeriesLimitExceeded(IngestRefused):
    """Applying the batch would take one run past its series budget (the run churns labels)."""

    outcome = "run_series_limit"


def check_budgets(
    runs: Mapping[str, RunSeries],
    series_count: int,
    reports: Sequence[Any],
    *,
    max_series: int,
    max_series_per_run: int,
) -> None:
    """Refuse (raise) a batch that would pass a run's budget or the store's cap."""
    # At most one new series per sample, plus three per run (step, last report
    # time, run_ended): when even that fits, skip counting (the hot path).
    bound: dict[str, int] = {}
    for r in reports:
        bound[r.run] = bound.get(r.run, 0) + len(r.samples) + len(r.coverage) + 3
    per_run = max_series_per_run
    # A budget as large as the cap is no budget: the cap decides (and is retryable).
    over_run = (
        []
        if per_run >= max_series
        else [name for name, n in bound.items() if n + (runs[name].n_series if name in runs else 0) > per_run]
    )
    if not over_run and series_count + sum(bound.values()) <= max_series:
        return
    added = count_new(runs, reports)
    for name in over_run:
        held = runs[name].n_series if name in runs else 0
        if held + added.get(name, 0) > per_run:
            raise RunSeriesLimitExceeded(
                f"run {name!r} would hold {held + added[name]} series, over the per-run budget of "
                f"{per_run} (max_series_per_run): it is creating new label values faster than "
                f"they expire; nothing of this batch was applied, other runs are unaffected"
            )
    total = sum(added.values())
    if series_count + total > max_series:
        raise SeriesLimitExceeded(
            f"series limit: this batch would add {total} series to the "
            f"{series_count} stored, over the collector's cap of "
            f"{max_series} (max_series); retry later"
        )


def count_new(runs: Mapping[str, RunSeries], reports: Sequence[Any]) -> dict[str, int]:
    """Series the reports would add per run (duplicates within them counted once)."""
    seen: set[tuple[str, int, str, LabelKey]] = set()
    added: dict[str, int] = {}
    ended: dict[str, bool] = {}  # run -> does its last report in the batch end it
    for report in reports:
        run = runs.get(report.run)
        ended[report.run] = ends_run(report)
        if run is None and report.run not in added:
            added[report.run] = 2
        else:
            added.setdefault(report.run, 0)
        fams = run.by_rank.get(report.rank, {}) if run is not None else {}
        for s in [*report.samples, *coverage_samples(report.coverage)]:
            key = label_key(s.labels)
            fam = fams.get(s.name)
            if fam is None or key not in fam:
                ident = (report.run, report.rank, s.name, key)
                if ident not in seen:
                    seen.add(ident)
                    added[report.run] += 1
    for name, ends in ended.items():
        if ends and (name not in runs or not runs[name].ended):
            added[name] += 1
    return added


_NAME_OF = attrgetter("name")


class NameRegistry:
    """The sample names accepted so far, for the gauge/counter clash check.

    A gauge ``x`` and a counter ``x_total`` would both be exposed as family
    ``trainvitals_x``; the first one accepted keeps the name for the collector's
    lifetime. (Names the collector exports itself are refused by the wire schema.)
    Not thread-safe: the store calls it under its lock.
    """

    __slots__ = ("known",)

    def __init__(self) -> None:
        self.known: set[str] = set()

    def check(self, reports: Sequence[Any]) -> set[str]:
        """Refuse (raise :class:`IngestRefused`) a clash; return the names not seen before
        (:meth:`accept` them once the batch is applied)."""
        known = self.known
        if all(known.issuperset(map(_NAME_OF, r.samples)) for r in reports):
            return set()  # the common case, in C: every name seen before
        fresh = {s.name for r in reports for s in r.samples} - known
        for name in sorted(fresh):
            # A batch built in process, not through the schema; the lifetime drift is the
            # collector's own, added to the reports before the store (monitor/lifetime.py).
            if name in RESERVED_NAMES and name != LIFETIME:
                raise IngestRefused(f"metric name {name!r} is produced by the collector; samples may not use it")
            family = exposed_family(name)  # a counter x_total and a gauge x: both family x
            other = family if family != name else name + "_total"
            if other in known or other in fresh:
                raise IngestRefused(
                    f"metric names {name!r} and {other!r} would both be exposed as {PREFIX}{family}; rename one"
                )
        return fresh

    def accept(self, names: set[str]) -> None:
        self.known.update(names)
