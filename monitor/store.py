"""The series store: the latest value of every series, per run, in plain Python.

No HTTP here. The ingest route validates a body into a ``ReportBatch`` and hands
it to :meth:`SeriesStore.ingest`; the exposition reads :meth:`SeriesStore.copy_runs`.

Series identity (what ``/metrics`` shows; the wire format is ``docs/wire.md``):

- name: ``PREFIX + sample.name``;
- labels: :func:`trainvitals.wire.series_labels` of the report's run and rank and
  the sample's own labels: ``run``, and ``rank`` only when it is not 0. A value
  from rank 0 and one from rank 1 are distinct series.
- per run, from the reports themselves, never from samples:
  ``trainvitals_step{run}`` (the step of the run's latest report, from whichever
  rank sent it), ``trainvitals_last_report_timestamp_seconds{run}`` (the
  collector's receive time) and ``trainvitals_run_ended{run}`` (present, 1, while
  the run's latest report carried a ``run_end`` event). ``docs/metrics.md`` lists them.

Counters (``*_total``) are cumulative on the client; the store keeps the latest
value like any gauge.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from trainvitals.wire import PREFIX, RESERVED_NAMES, RUN_END_EVENT, Report, ReportBatch, metric_type

__all__ = [
    "DEFAULT_MAX_SERIES",
    "IngestCallback",
    "IngestRefused",
    "RemovableHandle",
    "RunCopy",
    "RunInfo",
    "SeriesLimitExceeded",
    "SeriesStore",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_SERIES = 1_000_000

# A series inside one run and rank: its label items, sorted. The name is the outer key.
LabelKey = tuple[tuple[str, str], ...]
# wire name -> {label key: value}
Families = dict[str, dict[LabelKey, float]]
# What copy_runs() returns per run: (run, step, last report time, ended, per-rank series).
RunCopy = tuple[
    str, int, float, bool, list[tuple[int, list[tuple[str, list[tuple[LabelKey, float]]]]]]
]
IngestCallback = Callable[[ReportBatch, float], None]


class IngestRefused(ValueError):
    """A batch the store will not apply; nothing was changed."""


class SeriesLimitExceeded(IngestRefused):
    """Applying the batch would take the store past its series cap."""


@dataclass(frozen=True)
class RunInfo:
    """What ``GET /v1/runs`` shows for one run."""

    run: str
    step: int
    last_report_time: float
    ranks: tuple[int, ...]
    ended: bool = False
    """The run's latest report carried a ``run_end`` event."""


@dataclass
class _Run:
    step: int
    last_report_time: float
    # rank -> that rank's series
    by_rank: dict[int, Families] = field(default_factory=dict)
    # the latest report carried run_end: one more series (run_ended) while true
    ended: bool = False
    # series held, the per-run step, last-report-timestamp and run_ended series included
    n_series: int = 2

    def count(self) -> int:
        samples = sum(len(fam) for fams in self.by_rank.values() for fam in fams.values())
        return 2 + self.ended + samples


class RemovableHandle:
    """Undo a registration with :meth:`remove` (like ``torch.utils.hooks``)."""

    __slots__ = ("_remove",)

    def __init__(self, remove: Callable[[], None]) -> None:
        self._remove: Callable[[], None] | None = remove

    def remove(self) -> None:
        """Remove the registration; a second call does nothing."""
        fn, self._remove = self._remove, None
        if fn is not None:
            fn()


def _label_key(labels: dict[str, str]) -> LabelKey:
    # Inlined in SeriesStore.ingest (hot path); keep the two in step.
    return tuple(labels.items()) if len(labels) < 2 else tuple(sorted(labels.items()))


def _ends(report: Report) -> bool:
    """The report says its run ended (``Monitor.close()`` sent it)."""
    return any(ev.kind == RUN_END_EVENT for ev in report.events)


class SeriesStore:
    """Latest value per series, per run; thread-safe.

    ``ttl_seconds``: a run with no report for this long is dropped with all its
    series. ``max_series``: a batch that would exceed it is refused whole.
    """

    def __init__(
        self, *, ttl_seconds: float = 3600.0, max_series: int = DEFAULT_MAX_SERIES
    ) -> None:
        if ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be > 0, got {ttl_seconds}")
        if max_series < 1:
            raise ValueError(f"max_series must be >= 1, got {max_series}")
        self.ttl_seconds = float(ttl_seconds)
        self.max_series = int(max_series)
        self._lock = threading.Lock()
        self._runs: dict[str, _Run] = {}
        self._series_count = 0
        self._callbacks: list[IngestCallback] = []
        # Sample names already checked (reserved, type clash): skip on the hot path.
        self._known_names: set[str] = set()

    # -- subscriptions -----------------------------------------------------

    def on_ingest(self, callback: IngestCallback) -> RemovableHandle:
        """Call ``callback(batch, now)`` after each successful ingest.

        Runs on the ingesting thread (in the app: the event loop), after the
        store lock is released, so it may read the store; keep it quick and hand
        slow work (notifications) to another thread. An exception in a callback
        is logged and never fails the ingest.
        """
        with self._lock:
            self._callbacks.append(callback)

        def remove() -> None:
            with self._lock:
                try:
                    self._callbacks.remove(callback)
                except ValueError:
                    pass

        return RemovableHandle(remove)

    # -- writes ------------------------------------------------------------

    def ingest(self, batch: ReportBatch, now: float | None = None) -> int:
        """Apply a validated batch atomically; return the number of reports.

        Raises :class:`IngestRefused` (or :class:`SeriesLimitExceeded`) before
        changing anything.
        """
        if now is None:
            now = time.time()
        with self._lock:
            self._expire_locked(now)
            fresh_names = self._check_names_locked(batch)
            # At most one new series per sample, plus three per run (step, last
            # report time, run_ended): when even that fits, skip counting (the hot
            # path); otherwise count first.
            bound = sum(len(r.samples) + 3 for r in batch.reports)
            if self._series_count + bound > self.max_series:
                added = self._count_new_locked(batch)
                if self._series_count + added > self.max_series:
                    raise SeriesLimitExceeded(
                        f"series limit: this batch would add {added} series to the "
                        f"{self._series_count} stored, over the collector's cap of "
                        f"{self.max_series}"
                    )
            runs = self._runs
            for report in batch.reports:
                run = runs.get(report.run)
                if run is None:
                    run = runs[report.run] = _Run(step=report.step, last_report_time=now)
                    self._series_count += 2
                run.step = report.step
                run.last_report_time = now
                fams = run.by_rank.get(report.rank)
                if fams is None:
                    fams = run.by_rank[report.rank] = {}
                # Hot loop: no function calls beyond the builtins.
                for s in report.samples:
                    labels = s.labels
                    fam = fams.get(s.name)
                    if fam is None:
                        fam = fams[s.name] = {}
                    if len(labels) < 2:
                        fam[tuple(labels.items())] = s.value
                    else:
                        fam[tuple(sorted(labels.items()))] = s.value
                # A later report without run_end (any rank) means the run goes on.
                run.ended = _ends(report) if report.events else False
                count = run.count()
                self._series_count += count - run.n_series
                run.n_series = count
            self._known_names.update(fresh_names)
            callbacks = list(self._callbacks)
        for cb in callbacks:
            try:
                cb(batch, now)
            except Exception:
                log.exception("on_ingest callback %r failed; the batch was still ingested", cb)
        return len(batch.reports)

    def _count_new_locked(self, batch: ReportBatch) -> int:
        """Series the batch would add (duplicates within it counted once)."""
        seen: set[tuple[str, int, str, LabelKey]] = set()
        new_runs: set[str] = set()
        ended: dict[str, bool] = {}  # run -> does its last report in the batch end it
        for report in batch.reports:
            run = self._runs.get(report.run)
            ended[report.run] = _ends(report)
            if run is None:
                new_runs.add(report.run)
            fams = run.by_rank.get(report.rank, {}) if run is not None else {}
            for s in report.samples:
                key = _label_key(s.labels)
                fam = fams.get(s.name)
                if fam is None or key not in fam:
                    seen.add((report.run, report.rank, s.name, key))
        newly_ended = sum(
            1
            for name, ends in ended.items()
            if ends and (name not in self._runs or not self._runs[name].ended)
        )
        return len(seen) + 2 * len(new_runs) + newly_ended

    def _check_names_locked(self, batch: ReportBatch) -> set[str]:
        """Refuse collector-owned names and gauge/counter clashes; return new names.

        A gauge ``x`` and a counter ``x_total`` would both be exposed as family
        ``trainvitals_x``; the first one accepted keeps the name for the
        collector's lifetime.
        """
        known = self._known_names
        fresh = {s.name for r in batch.reports for s in r.samples} - known
        for name in sorted(fresh):
            if name in RESERVED_NAMES:
                raise IngestRefused(
                    f"metric name {name!r} is produced by the collector; samples may not use it"
                )
            if metric_type(name) == "counter":
                other = name[: -len("_total")] if name.endswith("_total") else name
            else:
                other = name + "_total"
            if other in known or other in fresh:
                raise IngestRefused(
                    f"metric names {name!r} and {other!r} would both be exposed as "
                    f"{PREFIX}{other.removesuffix('_total')}; rename one"
                )
        return fresh

    def expire(self, now: float | None = None) -> list[str]:
        """Drop runs silent for ``ttl_seconds``; return their names."""
        if now is None:
            now = time.time()
        with self._lock:
            return self._expire_locked(now)

    def _expire_locked(self, now: float) -> list[str]:
        cutoff = now - self.ttl_seconds
        gone = [name for name, run in self._runs.items() if run.last_report_time <= cutoff]
        for name in gone:
            run = self._runs.pop(name)
            self._series_count -= run.n_series
        if gone:
            log.info("expired %d run(s) silent for %.0f s: %s", len(gone), self.ttl_seconds, gone)
        return gone

    # -- reads -------------------------------------------------------------

    def __len__(self) -> int:
        """Number of series, the per-run step, timestamp and run_ended series included."""
        with self._lock:
            return self._series_count

    def runs(self, now: float | None = None) -> list[RunInfo]:
        """Runs still live, sorted by name."""
        if now is None:
            now = time.time()
        with self._lock:
            self._expire_locked(now)
            return [
                RunInfo(name, r.step, r.last_report_time, tuple(sorted(r.by_rank)), r.ended)
                for name, r in sorted(self._runs.items())
            ]

    def get(
        self, run: str, name: str, labels: dict[str, str] | None = None, *, rank: int = 0
    ) -> float | None:
        """The latest value of one series (wire name, no prefix), or None."""
        with self._lock:
            r = self._runs.get(run)
            if r is None:
                return None
            fam = r.by_rank.get(rank, {}).get(name)
            if fam is None:
                return None
            return fam.get(_label_key(labels or {}))

    def copy_runs(self, now: float | None = None) -> list[RunCopy]:
        """Expire silent runs, then copy the raw series out, in store order.

        Each run as ``(run, step, last_report_time, ended, [(rank, [(wire name,
        [(label items, value)])])])``; label items are sorted and exclude run
        and rank. :meth:`StoreCollector.render` reads this.
        """
        if now is None:
            now = time.time()
        with self._lock:
            self._expire_locked(now)
            # Copy each family's items under the lock; ingest mutates them in place.
            return [
                (
                    name,
                    r.step,
                    r.last_report_time,
                    r.ended,
                    [
                        (rank, [(m, list(f.items())) for m, f in fams.items()])
                        for rank, fams in r.by_rank.items()
                    ],
                )
                for name, r in self._runs.items()
            ]
