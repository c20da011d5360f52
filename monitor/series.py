"""The store's data model: one run's series, by rank, and the shapes the store hands out.

Plain containers and two helpers; the store (:mod:`trainvitals.monitor.store`) owns the
lock and every change. A series inside one run and rank is its wire name and its label
items (sorted); the value kept is the latest one, with the number of the rank's report
that set it (what the stale-series rule reads).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainvitals.monitor.dedup import SeqWindow

__all__ = ["Families", "LabelKey", "Labels", "RunCopy", "RunInfo", "RunSeries", "drop_stale", "label_key"]

# A series inside one run and rank: its label items, sorted. The name is the outer key.
LabelKey = tuple[tuple[str, str], ...]
# wire name -> {label key: (latest value, number of the rank's report that last set it)}
# (one entry per series: an update is one dict store; a tuple of a float and an int is
# untracked by the garbage collector, so a million series cost full collections nothing)
Families = dict[str, dict[LabelKey, tuple[float, int]]]
# What copy_runs() returns per run: (run, step, last report time, ended, per-rank series).
RunCopy = tuple[str, int, float, bool, list[tuple[int, list[tuple[str, list[tuple[LabelKey, float]]]]]]]


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
class RunSeries:
    """One run as the store holds it."""

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


def label_key(labels: dict[str, str]) -> LabelKey:
    # Inlined in SeriesStore.apply (hot path); keep the two in step.
    return tuple(labels.items()) if len(labels) < 2 else tuple(sorted(labels.items()))


def _read_only(self: Labels, *args: object, **kwargs: object) -> None:
    raise TypeError("Labels are shared by every sample spelled alike: copy them (dict(labels)) to change them")


class Labels(dict[str, str]):
    """A sample's labels as the collector's decoder hands them out: one object for all the
    samples whose labels are spelled alike (they repeat in every report), carrying the
    store's key for them (:func:`label_key`), so the store and the checks do their work
    once per spelling, not once per sample. A dict to every reader; read-only."""

    __slots__ = ("key",)

    def __init__(self, labels: dict[str, str]) -> None:
        super().__init__(labels)
        self.key: LabelKey = label_key(self)

    def __reduce__(self) -> tuple[type[Labels], tuple[dict[str, str]]]:  # copy, pickle
        return Labels, (dict(self),)

    __setitem__ = __delitem__ = __ior__ = _read_only  # type: ignore[assignment]
    update = pop = popitem = clear = setdefault = _read_only  # type: ignore[assignment]


def drop_stale(fams: Families, before: int) -> int:
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
