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
answered as retryable), as is one whose names clash (:mod:`~trainvitals.monitor.limits`);
a series that a rank has left out of its last ``stale_reports`` reports is dropped (a
run churning label values does not keep every value it ever sent), and a run silent for
``ttl_seconds`` with all its series. Reports that carry ``sender``/``seq`` are applied
once: a retried report is recognised and skipped (:mod:`~trainvitals.monitor.dedup`;
:class:`IngestResult` lists them). Subscribers (:meth:`SeriesStore.on_ingest`) are told
of every batch applied (:mod:`~trainvitals.monitor.callbacks`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainvitals.monitor.callbacks import Applied, IngestCallback, IngestCallbacks, IngestedBatch
from trainvitals.monitor.dedup import SeqWindow, fresh_reports, remember
from trainvitals.monitor.handles import RemovableHandle
from trainvitals.monitor.limits import (
    DEFAULT_MAX_SERIES,
    IngestRefused,
    NameRegistry,
    RunSeriesLimitExceeded,
    SeriesLimitExceeded,
    check_budgets,
)
from trainvitals.monitor.series import LabelKey, Labels, RunCopy, RunInfo, RunSeries, drop_stale, label_key
from trainvitals.wire import ReportBatch, ends_run
from trainvitals.wire.coverage import ACTIVE_METRIC, coverage_samples

if TYPE_CHECKING:
    from trainvitals.monitor.decode import WireBatch

# Names defined in limits, series and callbacks are re-exported: the store's API.
__all__ = [
    "DEFAULT_MAX_SERIES",
    "IngestCallback",
    "IngestRefused",
    "IngestResult",
    "IngestedBatch",
    "LabelKey",
    "RemovableHandle",
    "RunCopy",
    "RunInfo",
    "RunSeriesLimitExceeded",
    "SeriesLimitExceeded",
    "SeriesStore",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IngestResult:
    """What one ingest did: reports applied, and the indices of the duplicates skipped."""

    accepted: int
    duplicates: tuple[int, ...] = ()
    new_runs: tuple[str, ...] = ()
    """Runs this batch started (not held before: first report, or after they expired)."""


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
        self._runs: dict[str, RunSeries] = {}
        self._series_count = 0
        self._callbacks = IngestCallbacks()
        self._names = NameRegistry()
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
        return self._callbacks.add(callback)

    # -- writes ------------------------------------------------------------

    def restore_run(self, run: str, step: int, last_report_time: float, ended: bool) -> None:
        """Bring back a run known before a restart (no series: they come with its next report)."""
        with self._lock:
            if run in self._runs:
                return
            self._runs[run] = RunSeries(step=step, last_report_time=last_report_time, ended=ended, n_series=2 + ended)
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
            runs = self._runs
            reports, duplicates = fresh_reports(runs, batch.reports)
            fresh_names = self._names.check(reports)
            check_budgets(
                runs,
                self._series_count,
                reports,
                max_series=self.max_series,
                max_series_per_run=self.max_series_per_run,
            )
            stale = self.stale_reports
            new_runs: list[str] = []
            for report in reports:
                run = runs.get(report.run)
                if run is None:
                    run = runs[report.run] = RunSeries(step=report.step, last_report_time=now)
                    self._series_count += 2
                    new_runs.append(report.run)
                run.step = report.step
                run.last_report_time = now
                rank = report.rank
                if report.seq is not None:
                    remember(run.seqs, rank, report.sender, report.seq)
                fams = run.by_rank.get(rank)
                if fams is None:
                    fams = run.by_rank[rank] = {}
                gen = run.reports[rank] = run.reports.get(rank, 0) + 1
                # Hot loop: no function calls beyond the builtins. The decoder's shared
                # Labels carry their key; other labels (a ReportBatch) are keyed here.
                for s in report.samples:
                    labels = s.labels
                    fam = fams.get(s.name)
                    if fam is None:
                        fam = fams[s.name] = {}
                    if labels.__class__ is Labels:
                        fam[labels.key] = (s.value, gen)
                    else:
                        key = tuple(labels.items()) if len(labels) < 2 else tuple(sorted(labels.items()))
                        fam[key] = (s.value, gen)
                if report.coverage:
                    # The report's coverage replaces the rank's previous one whole (a
                    # reason that changed leaves no series behind).
                    fam = fams[ACTIVE_METRIC] = {}
                    for c in coverage_samples(report.coverage):
                        fam[tuple(sorted(c.labels.items()))] = (c.value, gen)
                if stale and gen % stale == 0:
                    self.stale_dropped += drop_stale(fams, gen - stale)
                # The run end's one meaning (wire.ends_run): the latest report decides.
                run.ended = ends_run(report) if report.events else False
                count = run.count()
                self._series_count += count - run.n_series
                run.n_series = count
            if fresh_names:
                self._names.accept(fresh_names)
            callbacks = self._callbacks.snapshot()
        if reports:
            applied = batch if len(reports) == len(batch.reports) else Applied(reports)
            IngestCallbacks.call(callbacks, applied, now)
        return IngestResult(len(reports), tuple(duplicates), tuple(new_runs))

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
            cell = fam.get(label_key(labels or {}))
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
