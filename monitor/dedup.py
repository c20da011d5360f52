"""Idempotent ingest: which (run, rank, sender) sequence numbers the store has applied.

A job's sender numbers its reports (``sender``, ``seq``) and retries what was not
acknowledged; the store applies each number once (:class:`SeqWindow`, one per run, rank
and sender), remembering a bounded window of them; :func:`fresh_reports` sorts a batch
into the reports to apply and the duplicates to skip.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

__all__ = ["SEQ_WINDOW", "SeqWindow", "fresh_reports", "remember"]

SEQ_WINDOW = 4096  # sequence numbers remembered per (run, rank, sender)


class SeqWindow:
    """The sequence numbers seen from one sender of one run and rank.

    Senders number reports in order and retry the oldest first, so everything
    below ``floor`` (the window's forgotten tail) was seen: treated as a duplicate.
    """

    __slots__ = ("floor", "seen")

    def __init__(self) -> None:
        self.floor = -1
        self.seen: dict[int, None] = {}

    def duplicate(self, seq: int) -> bool:
        return seq <= self.floor or seq in self.seen

    def add(self, seq: int) -> None:
        seen = self.seen
        seen[seq] = None
        if len(seen) > SEQ_WINDOW:
            for old in list(seen)[: SEQ_WINDOW // 2]:
                del seen[old]
                if old > self.floor:
                    self.floor = old


class _HasSeqs(Protocol):
    """A run as the store holds it (:class:`~trainvitals.monitor.series.RunSeries`)."""

    seqs: dict[tuple[int, str], SeqWindow]


def fresh_reports(runs: Mapping[str, _HasSeqs], reports: list[Any]) -> tuple[list[Any], list[int]]:
    """The reports not applied before (nor earlier in this batch), and the others' indices."""
    if all(r.seq is None for r in reports):
        return reports, []
    fresh, dups = [], []
    in_batch: set[tuple[str, int, str, int]] = set()
    for i, r in enumerate(reports):
        if r.seq is not None:
            ident = (r.run, r.rank, r.sender, r.seq)
            run = runs.get(r.run)
            seqs = run.seqs.get((r.rank, r.sender)) if run is not None else None
            if ident in in_batch or (seqs is not None and seqs.duplicate(r.seq)):
                dups.append(i)
                continue
            in_batch.add(ident)
        fresh.append(r)
    return fresh, dups


def remember(seqs: dict[tuple[int, str], SeqWindow], rank: int, sender: str, seq: int) -> None:
    """Record ``seq`` as applied for ``(rank, sender)`` of one run."""
    window = seqs.get((rank, sender))
    if window is None:
        window = seqs[(rank, sender)] = SeqWindow()
    window.add(seq)
