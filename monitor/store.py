"""The series store: the latest value of every series, per run, in plain Python.

No HTTP here. The ingest route validates a body (into the decoder's ``WireBatch``; a
``ReportBatch`` of the wire's models works the same) and hands it to
:meth:`SeriesStore.apply`; the exposition reads :meth:`SeriesStore.copy_runs`.

Series identity (what ``/metrics`` shows; the wire format is ``docs/wire.md``):

- name: ``PREFIX + sample.name``;
- labels: :func:`trainvitals.wire.series_labels` of the report's run and rank and
  the sample's own labels: ``run``, and ``rank`` only when it is not 0. A value
  from rank 0 and one from rank 1 are distinct series.
- per run, from the reports themselves, never from samples:
  ``trainvitals_step{run}`` (the step of the run's latest report, from whichever
  rank sent it), ``trainvitals_last_report_timestamp_seconds{run}`` (the
  collector's receive time) and ``trainvitals_run_ended{run}`` (present, 1, while
  the run's latest report carried a ``run_end`` event), and per rank
  ``trainvitals_signal_active{run, signal, reason}`` from the report's ``coverage``
  (the latest report that had one). ``docs/metrics.md`` lists them.

Counters (``*_total``) are cumulative on the client; the store keeps the latest
value like any gauge.

Limits and hygiene: a batch that would take one run past ``max_series_per_run``
is refused (:class:`RunSeriesLimitExceeded`; other runs are unaffected) and one
that would take the store past ``max_series`` too (:class:`SeriesLimitExceeded`,
answered as retryable); a series that a rank has left out of its last
``stale_reports`` reports is dropped (a run churning label values does not keep
every value it ever sent). Reports that carry ``sender``/``seq`` are applied once:
a retried report is recognised and skipped (:class:`IngestResult` lists them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Protocol

from trainvitals.monitor.dedup import SeqWindow
from trainvitals.monitor.handles import RemovableHandle
from trainvitals.wire import PREFIX, RESERVED_NAMES, Report, ReportBatch, ends_run, exposed_family
from trainvitals.wire.coverage import ACTIVE_METRIC, coverage_samples
from trainvitals.wire.errors import Refused

if TYPE_CHECKING:
    from trainvitals.monitor.decode import WireBatch, WireReport

__all__ = [
    "DEFAULT_MAX_SERIES",
    "IngestCallback",
    "IngestRefused",
    "IngestResult",
    "IngestedBatch",
    "RemovableHandle",
    "RunCopy",
    "RunInfo",
    "RunSeriesLimitExceeded",
    "SeriesLimitExceeded",
    "SeriesStore",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_SERIES = 1_000_000

# A series inside one run and rank: its label items, sorted. The name is the outer key.
LabelKey = tuple[tuple[str, str], ...]
# wire name -> {label key: (latest value, number of the rank's report that last set it)}
# (one entry per series: an update is one dict store; a tuple of a float and an int is
# untracked by the garbage collector, so a million series cost full collections nothing)
Families = dict[str, dict[LabelKey, tuple[float, int]]]
# What copy_runs() returns per run: (run, step, last report time, ended, per-rank series).
RunCopy = tuple[str, int, float, bool, list[tuple[int, list[tuple[str, list[tuple[LabelKey, float]]]]]]]


class IngestedBatch(Protocol):
    """What ``on_ingest`` callbacks get: the reports applied, as the wire's pydantic models
    (:meth:`SeriesStore.apply` of a ``ReportBatch``) or as the collector decoder's structs
    (the ingest route's ``WireBatch``); both have the same attributes."""

    @property
    def reports(self) -> Sequence[Report] | Sequence[WireReport]: ...


# Called as callback(batch, now); what it returns is ignored.
IngestCallback = Callable[[IngestedBatch, float], object]


class IngestRefused(Refused, ValueError):
    """A batch the store will not apply; nothing was changed (422)."""


FULL_RETRY_AFTER = 30
"""Seconds a client should wait before retrying when the collector is full."""


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


@dataclass(frozen=True)
class IngestResult:
    """What one ingest did: reports applied, and the indices of the duplicates skipped."""

    accepted: int
    duplicates: tuple[int, ...] = ()
    new_runs: tuple[str, ...] = ()
    """Runs this batch started (not held before: first report, or after they expired)."""


class _Applied:
    """The reports of a batch that were applied (what on_ingest callbacks get)."""

    __slots__ = ("reports",)

    def __init__(self, reports: list[Report] | list[WireReport]) -> None:
        self.reports = reports


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
    # rank -> reports received from it
    reports: dict[int, int] = field(default_factory=dict)
    # (rank, sender) -> sequence numbers seen
    seqs: dict[tuple[int, str], SeqWindow] = field(default_factory=dict)

    def count(self) -> int:
        samples = sum(len(fam) for fams in self.by_rank.values() for fam in fams.values())
        return 2 + self.ended + samples


_NAME_OF = attrgetter("name")


def _label_key(labels: dict[str, str]) -> LabelKey:
    # Inlined in SeriesStore.ingest (hot path); keep the two in step.
    return tuple(labels.items()) if len(labels) < 2 else tuple(sorted(labels.items()))


def _drop_stale(fams: Families, before: int) -> int:
    """Drop the series of one rank last set by a report numbered ``before`` or earlier."""
    dropped = 0
    for name in list(fams):
        fam = fams[name]
        old = [key for key, cell in fam.items() if cell[1] <= before]
        if not old:
            continue
        for key in old:
            del fam[key]
        dropped += len(old)
        if not fam:
            del fams[name]
    return dropped


class SeriesStore:
    """Latest value per series, per run; thread-safe.

    ``ttl_seconds``: a run with no report for this long is dropped with all its
    series. ``max_series``: a batch that would exceed it is refused whole.
    ``max_series_per_run``: the same, for one run's series (default: ``max_series``).
    ``stale_reports``: a series its rank left out of this many consecutive
    reports is dropped (0: never).
    """

    def __init__(
        self,
        *,
        ttl_seconds: float = 3600.0,
        max_series: int = DEFAULT_MAX_SERIES,
        max_series_per_run: int | None = None,
        stale_reports: int = 0,
    ) -> None:
        if ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be > 0, got {ttl_seconds}")
        if max_series < 1:
            raise ValueError(f"max_series must be >= 1, got {max_series}")
        if max_series_per_run is not None and max_series_per_run < 4:
            raise ValueError(f"max_series_per_run must be >= 4, got {max_series_per_run}")
        if stale_reports < 0:
            raise ValueError(f"stale_reports must be >= 0, got {stale_reports}")
        self.ttl_seconds = float(ttl_seconds)
        self.max_series = int(max_series)
        self.max_series_per_run = int(max_series_per_run or max_series)
        self.stale_reports = int(stale_reports)
        self._lock = threading.Lock()
        self._runs: dict[str, _Run] = {}
        self._series_count = 0
        self._callbacks: list[IngestCallback] = []
        # Sample names already checked (type clash): skip on the hot path.
        self._known_names: set[str] = set()
        self.stale_dropped = 0
        """Series dropped because their rank stopped sending them (``stale_reports``)."""

    # -- subscriptions -----------------------------------------------------

    def on_ingest(self, callback: IngestCallback) -> RemovableHandle:
        """Call ``callback(batch, now)`` after each successful ingest.

        ``batch.reports`` holds the reports applied (duplicates left out). Runs
        on the ingesting thread, after the store lock is released, so it may read
        the store; keep it quick and hand slow work (notifications) to another
        thread. An exception in a callback is logged and never fails the ingest.
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

    def restore_run(self, run: str, step: int, last_report_time: float, ended: bool) -> None:
        """Bring back a run known before a restart (no series: they come with its next report)."""
        with self._lock:
            if run in self._runs:
                return
            self._runs[run] = _Run(step=step, last_report_time=last_report_time, ended=ended, n_series=2 + ended)
            self._series_count += 2 + ended

    def restore_seqs(self, run: str, rank: int, sender: str, floor: int, seqs: list[int]) -> None:
        """Bring back the reports a sender had applied before a restart: every ``seq`` at or
        below ``floor``, and those in ``seqs`` (for a run already restored; else nothing)."""
        with self._lock:
            r = self._runs.get(run)
            if r is None:
                return
            known = r.seqs.get((rank, sender))
            if known is None:
                known = r.seqs[(rank, sender)] = SeqWindow()
            known.floor = max(known.floor, floor)
            for seq in sorted(seqs):
                known.add(seq)

    def ingest(self, batch: ReportBatch | WireBatch, now: float | None = None) -> int:
        """Apply a validated batch atomically; return the number of reports applied.

        Raises :class:`IngestRefused` (or one of its subclasses) before changing
        anything. :meth:`apply` also says which reports were duplicates.
        """
        return self.apply(batch, now).accepted

    def apply(self, batch: ReportBatch | WireBatch, now: float | None = None) -> IngestResult:
        """Apply a validated batch atomically, skipping reports already applied.

        A report with ``sender``/``seq`` whose (run, rank, sender, seq) was applied
        before (a client's retry) is skipped and listed in ``duplicates`` (indices
        into ``batch.reports``). Raises :class:`IngestRefused` before changing anything.
        """
        if now is None:
            now = time.time()
        with self._lock:
            self._expire_locked(now)
            reports, duplicates = self._fresh_locked(batch.reports)
            fresh_names = self._check_names_locked(reports)
            self._check_limits_locked(reports)
            runs = self._runs
            stale = self.stale_reports
            new_runs: list[str] = []
            for report in reports:
                run = runs.get(report.run)
                if run is None:
                    run = runs[report.run] = _Run(step=report.step, last_report_time=now)
                    self._series_count += 2
                    new_runs.append(report.run)
                run.step = report.step
                run.last_report_time = now
                rank = report.rank
                if report.seq is not None:
                    seqs = run.seqs.get((rank, report.sender))
                    if seqs is None:
                        seqs = run.seqs[(rank, report.sender)] = SeqWindow()
                    seqs.add(report.seq)
                fams = run.by_rank.get(rank)
                if fams is None:
                    fams = run.by_rank[rank] = {}
                gen = run.reports[rank] = run.reports.get(rank, 0) + 1
                # Hot loop: no function calls beyond the builtins.
                for s in report.samples:
                    labels = s.labels
                    fam = fams.get(s.name)
                    if fam is None:
                        fam = fams[s.name] = {}
                    key = tuple(labels.items()) if len(labels) < 2 else tuple(sorted(labels.items()))
                    fam[key] = (s.value, gen)
                if report.coverage:
                    # The report's coverage replaces the rank's previous one whole (a
                    # reason that changed leaves no series behind).
                    fam = fams[ACTIVE_METRIC] = {}
                    for c in coverage_samples(report.coverage):
                        fam[tuple(sorted(c.labels.items()))] = (c.value, gen)
                if stale and gen % stale == 0:
                    self.stale_dropped += _drop_stale(fams, gen - stale)
                # A later report without run_end (any rank) means the run goes on.
                run.ended = ends_run(report) if report.events else False
                count = run.count()
                self._series_count += count - run.n_series
                run.n_series = count
            self._known_names.update(fresh_names)
            callbacks = list(self._callbacks)
        if reports:
            applied = batch if len(reports) == len(batch.reports) else _Applied(reports)
            for cb in callbacks:
                try:
                    cb(applied, now)
                except Exception:
                    log.exception("on_ingest callback %r failed; the batch was still ingested", cb)
        return IngestResult(len(reports), tuple(duplicates), tuple(new_runs))

    def _fresh_locked(self, reports: list[Any]) -> tuple[list[Any], list[int]]:
        """The reports not applied before (nor earlier in this batch), and the others' indices."""
        if all(r.seq is None for r in reports):
            return reports, []
        fresh, dups = [], []
        in_batch: set[tuple[str, int, str, int]] = set()
        for i, r in enumerate(reports):
            if r.seq is not None:
                ident = (r.run, r.rank, r.sender, r.seq)
                run = self._runs.get(r.run)
                seqs = run.seqs.get((r.rank, r.sender)) if run is not None else None
                if ident in in_batch or (seqs is not None and seqs.duplicate(r.seq)):
                    dups.append(i)
                    continue
                in_batch.add(ident)
            fresh.append(r)
        return fresh, dups

    def _check_limits_locked(self, reports: list[Any]) -> None:
        """Refuse a batch that would pass a run's budget or the store's cap."""
        # At most one new series per sample, plus three per run (step, last report
        # time, run_ended): when even that fits, skip counting (the hot path).
        bound: dict[str, int] = {}
        for r in reports:
            bound[r.run] = bound.get(r.run, 0) + len(r.samples) + len(r.coverage) + 3
        per_run = self.max_series_per_run
        # A budget as large as the cap is no budget: the cap decides (and is retryable).
        over_run = (
            []
            if per_run >= self.max_series
            else [
                name
                for name, n in bound.items()
                if n + (self._runs[name].n_series if name in self._runs else 0) > per_run
            ]
        )
        if not over_run and self._series_count + sum(bound.values()) <= self.max_series:
            return
        added = self._count_new_locked(reports)
        for name in over_run:
            held = self._runs[name].n_series if name in self._runs else 0
            if held + added.get(name, 0) > per_run:
                raise RunSeriesLimitExceeded(
                    f"run {name!r} would hold {held + added[name]} series, over the per-run budget of "
                    f"{per_run} (max_series_per_run): it is creating new label values faster than "
                    f"they expire; nothing of this batch was applied, other runs are unaffected"
                )
        total = sum(added.values())
        if self._series_count + total > self.max_series:
            raise SeriesLimitExceeded(
                f"series limit: this batch would add {total} series to the "
                f"{self._series_count} stored, over the collector's cap of "
                f"{self.max_series} (max_series); retry later"
            )

    def _count_new_locked(self, reports: list[Any]) -> dict[str, int]:
        """Series the reports would add per run (duplicates within them counted once)."""
        seen: set[tuple[str, int, str, LabelKey]] = set()
        added: dict[str, int] = {}
        ended: dict[str, bool] = {}  # run -> does its last report in the batch end it
        for report in reports:
            run = self._runs.get(report.run)
            ended[report.run] = ends_run(report)
            if run is None and report.run not in added:
                added[report.run] = 2
            else:
                added.setdefault(report.run, 0)
            fams = run.by_rank.get(report.rank, {}) if run is not None else {}
            for s in [*report.samples, *coverage_samples(report.coverage)]:
                key = _label_key(s.labels)
                fam = fams.get(s.name)
                if fam is None or key not in fam:
                    ident = (report.run, report.rank, s.name, key)
                    if ident not in seen:
                        seen.add(ident)
                        added[report.run] += 1
        for name, ends in ended.items():
            if ends and (name not in self._runs or not self._runs[name].ended):
                added[name] += 1
        return added

    def _check_names_locked(self, reports: list[Any]) -> set[str]:
        """Refuse gauge/counter clashes; return the names not seen before.

        A gauge ``x`` and a counter ``x_total`` would both be exposed as family
        ``trainvitals_x``; the first one accepted keeps the name for the
        collector's lifetime. (Names the collector exports itself are refused by
        the wire schema.)
        """
        known = self._known_names
        if all(known.issuperset(map(_NAME_OF, r.samples)) for r in reports):
            return set()  # the common case, in C: every name seen before
        fresh = {s.name for r in reports for s in r.samples} - known
        for name in sorted(fresh):
            if name in RESERVED_NAMES:  # a batch built in process, not through the schema
                raise IngestRefused(f"metric name {name!r} is produced by the collector; samples may not use it")
            family = exposed_family(name)  # a counter x_total and a gauge x: both family x
            other = family if family != name else name + "_total"
            if other in known or other in fresh:
                raise IngestRefused(
                    f"metric names {name!r} and {other!r} would both be exposed as {PREFIX}{family}; rename one"
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

    def get(self, run: str, name: str, labels: dict[str, str] | None = None, *, rank: int = 0) -> float | None:
        """The latest value of one series (wire name, no prefix), or None."""
        with self._lock:
            r = self._runs.get(run)
            if r is None:
                return None
            fam = r.by_rank.get(rank, {}).get(name)
            if fam is None:
                return None
            cell = fam.get(_label_key(labels or {}))
            return None if cell is None else cell[0]

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
                        (rank, [(m, [(k, c[0]) for k, c in f.items()]) for m, f in fams.items()])
                        for rank, fams in r.by_rank.items()
                    ],
                )
                for name, r in self._runs.items()
            ]
