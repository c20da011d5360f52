"""The series store: the latest value of every series, per run, in plain Python.

No HTTP here. The ingest API validates a body into a ``ReportBatch`` and hands it
to :meth:`SeriesStore.ingest`; the exposition reads :meth:`SeriesStore.snapshot`
(full label sets) or :meth:`SeriesStore.copy_runs` (raw, for the fast renderer).

Series identity and labels (what ``/metrics`` shows):

- name: ``PREFIX + sample.name``;
- labels: ``run`` (the report's run), the sample's own labels, and ``rank`` only
  when the report's rank is not 0. Rank 0 is the run's voice: it sends the
  values that are global to the job (DESIGN "Data-parallel"), so they carry no
  rank label. Other ranks send per-rank series only, and those carry
  ``rank="N"``. A value from rank 0 and one from rank 1 are distinct series.
- ``trainvitals_step{run}`` and ``trainvitals_last_report_timestamp_seconds{run}``
  come from the reports themselves, never from samples: the step of the run's
  latest report (from whichever rank sent it) and the collector's receive time.

Counters (``*_total``) are cumulative on the client; the store keeps the latest
value like any gauge.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from trainvitals.wire import PREFIX, RESERVED_NAMES, Event, ReportBatch, metric_type

__all__ = [
    "DEFAULT_MAX_EVENTS",
    "DEFAULT_MAX_SERIES",
    "RESERVED_NAMES",
    "IngestCallback",
    "IngestRefused",
    "RemovableHandle",
    "RunCopy",
    "RunInfo",
    "SeriesLimitExceeded",
    "SeriesStore",
    "Snapshot",
    "StoredEvent",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_SERIES = 1_000_000
DEFAULT_MAX_EVENTS = 10_000


# A series inside one run and rank: its label items, sorted. The name is the outer key.
LabelKey = tuple[tuple[str, str], ...]
# wire name -> {label key: value}
Families = dict[str, dict[LabelKey, float]]
# What copy_runs() returns per run: (run, step, last report time, per-rank series).
RunCopy = tuple[str, int, float, list[tuple[int, list[tuple[str, list[tuple[LabelKey, float]]]]]]]
IngestCallback = Callable[[ReportBatch, float], None]


class IngestRefused(ValueError):
    """A batch the store will not apply; nothing was changed."""


class SeriesLimitExceeded(IngestRefused):
    """Applying the batch would take the store past its series cap."""


@dataclass(frozen=True)
class StoredEvent:
    """An event as received: which run, rank and step it came with, and when."""

    run: str
    rank: int
    step: int
    time: float
    received: float
    event: Event


@dataclass(frozen=True)
class RunInfo:
    """What ``GET /v1/runs`` shows for one run."""

    run: str
    step: int
    last_report_time: float
    ranks: tuple[int, ...]


@dataclass
class _Run:
    step: int
    last_report_time: float
    # rank -> that rank's series
    by_rank: dict[int, Families] = field(default_factory=dict)
    # series held, the step and last-report-timestamp series included
    n_series: int = 2

    def count(self) -> int:
        return 2 + sum(len(fam) for fams in self.by_rank.values() for fam in fams.values())


@dataclass(frozen=True)
class Snapshot:
    """A consistent copy for exposition.

    ``families`` maps the full Prometheus name to (type, list of (labels, value)),
    names sorted. ``runs`` holds the per-run step and receive time.
    """

    families: list[tuple[str, str, list[tuple[dict[str, str], float]]]]
    runs: list[RunInfo]
    series_count: int


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


class SeriesStore:
    """Latest value per series, per run; thread-safe.

    ``ttl_seconds``: a run with no report for this long is dropped with all its
    series. ``max_series``: a batch that would exceed it is refused whole.
    ``max_events``: how many recent events are kept (oldest dropped first).
    """

    def __init__(
        self,
        *,
        ttl_seconds: float = 3600.0,
        max_series: int = DEFAULT_MAX_SERIES,
        max_events: int = DEFAULT_MAX_EVENTS,
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
        self._events: deque[StoredEvent] = deque(maxlen=max_events)
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
            # At most one new series per sample, plus two per new run: when even
            # that fits, skip counting (the hot path); otherwise count first.
            bound = sum(len(r.samples) + 2 for r in batch.reports)
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
                if report.events:
                    for ev in report.events:
                        self._events.append(
                            StoredEvent(report.run, report.rank, report.step, report.time, now, ev)
                        )
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
        for report in batch.reports:
            run = self._runs.get(report.run)
            if run is None:
                new_runs.add(report.run)
            fams = run.by_rank.get(report.rank, {}) if run is not None else {}
            for s in report.samples:
                key = _label_key(s.labels)
                fam = fams.get(s.name)
                if fam is None or key not in fam:
                    seen.add((report.run, report.rank, s.name, key))
        return len(seen) + 2 * len(new_runs)

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
        """Number of series, the per-run step and timestamp series included."""
        with self._lock:
            return self._series_count

    def runs(self, now: float | None = None) -> list[RunInfo]:
        """Runs still live, sorted by name."""
        if now is None:
            now = time.time()
        with self._lock:
            self._expire_locked(now)
            return [
                RunInfo(name, r.step, r.last_report_time, tuple(sorted(r.by_rank)))
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

    def events(self, run: str | None = None, since: float | None = None) -> list[StoredEvent]:
        """Recent events, oldest first; optionally one run's, received after ``since``."""
        with self._lock:
            evs = list(self._events)
        return [
            e
            for e in evs
            if (run is None or e.run == run) and (since is None or e.received > since)
        ]

    def copy_runs(self, now: float | None = None) -> list[RunCopy]:
        """Expire silent runs, then copy the raw series out, in store order.

        Each run as ``(run, step, last_report_time, [(rank, [(wire name,
        [(label items, value)])])])``; label items are sorted and exclude run
        and rank. The fast path of the exposition reads this.
        """
        if now is None:
            now = time.time()
        with self._lock:
            self._expire_locked(now)
            return self._copy_locked()

    def _copy_locked(self) -> list[RunCopy]:
        # Copy each family's items under the lock; ingest mutates them in place.
        return [
            (
                name,
                r.step,
                r.last_report_time,
                [
                    (rank, [(m, list(f.items())) for m, f in fams.items()])
                    for rank, fams in r.by_rank.items()
                ],
            )
            for name, r in self._runs.items()
        ]

    def snapshot(self, now: float | None = None) -> Snapshot:
        """Expire silent runs, then copy everything out with full label sets."""
        if now is None:
            now = time.time()
        with self._lock:
            self._expire_locked(now)
            items = self._copy_locked()
            count = self._series_count
        by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
        runs: list[RunInfo] = []
        for run_name, step, last, per_rank in items:
            runs.append(RunInfo(run_name, step, last, tuple(sorted(r for r, _ in per_rank))))
            for rank, fams in per_rank:
                rank_label = str(rank) if rank else None
                for name, series in fams:
                    out = by_name.get(name)
                    if out is None:
                        out = by_name[name] = []
                    for label_items, value in series:
                        labels = dict(label_items)
                        labels["run"] = run_name
                        if rank_label is not None:
                            labels["rank"] = rank_label
                        out.append((labels, value))
        families = [(PREFIX + name, metric_type(name), by_name[name]) for name in sorted(by_name)]
        runs.sort(key=lambda r: r.run)
        return Snapshot(families=families, runs=runs, series_count=count)
