"""Idempotent ingest: which (run, rank, sender) sequence numbers the store has applied.

A job's sender numbers its reports (``sender``, ``seq``) and retries what was not
acknowledged; the store applies each number once (:class:`SeqWindow`, one per run, rank
and sender), remembering a bounded window of them.
"""

from __future__ import annotations

__all__ = ["SEQ_WINDOW", "SeqWindow"]

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
