"""The reports applied, in the state file: per run, rank and sender, the ``seq``
numbers applied (the newest :data:`~trainvitals.monitor.dedup.SEQ_WINDOW`; older ones
count as applied), so a retry that straddles a restart is recognised as a duplicate.

Written with each accepted body, before the answer goes out. What the disk refuses is
kept in memory and written with the next success; until then the ingest answers 503.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from trainvitals.monitor.dedup import SEQ_WINDOW
from trainvitals.monitor.state_writes import StateWriteError, StateWrites
from trainvitals.wire import ends_run

__all__ = ["SeqTables"]

_MAX_UNSAVED_SEQS = 1_000_000  # seq rows held in memory while the disk refuses them


class SeqTables(StateWrites):
    """The ``seq`` numbers applied (:meth:`record_seqs` is an ``on_ingest`` callback)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        # Sequence numbers recorded per (run, rank, sender) since its last prune.
        self._since_prune: dict[tuple[str, int, str], int] = {}
        self._unsaved_seqs: list[tuple[str, int, str, int]] = []
        self._unsaved_runs: dict[str, tuple[str, float, int, int]] = {}

    def record_seqs(self, batch: Any, now: float | None = None) -> None:
        """Remember the ``seq`` of every report in ``batch`` that has one, and its run (the
        store's ``on_ingest`` signature: called with the reports applied, before the answer).

        The run is written too, so that a crash before the next batched save of the runs
        still brings the run, and so its duplicate memory, back. Never raises: what the
        disk refuses is kept and written with the next success; :meth:`seqs_saved` says
        whether everything is written (the ingest answers 503 until it is)."""
        now = time.time() if now is None else now
        rows = [(r.run, r.rank, r.sender, r.seq) for r in batch.reports if r.seq is not None]
        if not rows:
            return
        runs = {r.run: (r.run, now, r.step, int(ends_run(r))) for r in batch.reports}
        with self._lock:
            if len(self._unsaved_seqs) < _MAX_UNSAVED_SEQS:
                self._unsaved_seqs.extend(rows)
            self._unsaved_runs.update(runs)
            self._flush_seqs_locked()

    def seqs_saved(self) -> bool:
        """True when every ``seq`` recorded is in the file (tries again what was not)."""
        if not self._unsaved_seqs:
            return True
        with self._lock:
            return self._flush_seqs_locked()

    def _flush_seqs_locked(self) -> bool:
        rows, runs = self._unsaved_seqs, list(self._unsaved_runs.values())
        if not rows and not runs:
            return True
        prune = []
        counts = dict(self._since_prune)
        for run, rank, sender, _ in rows:
            key = (run, rank, sender)
            n = counts[key] = counts.get(key, 0) + 1
            if n >= SEQ_WINDOW:
                prune.append(key)
                counts[key] = 0

        def body() -> None:
            self._db.executemany("INSERT OR IGNORE INTO seqs VALUES (?, ?, ?, ?)", rows)
            self._db.executemany(
                "INSERT INTO runs VALUES (?, ?, ?, ?) ON CONFLICT(run) DO UPDATE SET "
                "last_seen = max(last_seen, excluded.last_seen), last_step = excluded.last_step, "
                "ended = excluded.ended",
                runs,
            )
            for run, rank, sender in prune:
                self._prune_locked(run, rank, sender)

        try:
            self._tx("seqs", body)
        except StateWriteError:
            return False
        self._since_prune = counts
        self._unsaved_seqs = []
        self._unsaved_runs = {}
        return True

    def _prune_locked(self, run: str, rank: int, sender: str) -> None:
        """Keep the newest SEQ_WINDOW numbers of one sender; the rest become its floor."""
        row = self._db.execute(
            "SELECT seq FROM seqs WHERE run = ? AND rank = ? AND sender = ? ORDER BY seq DESC LIMIT 1 OFFSET ?",
            (run, rank, sender, SEQ_WINDOW),
        ).fetchone()
        if row is None:
            return
        floor = int(row[0])
        self._db.execute(
            "DELETE FROM seqs WHERE run = ? AND rank = ? AND sender = ? AND seq <= ?", (run, rank, sender, floor)
        )
        self._db.execute(
            "INSERT INTO seq_floors VALUES (?, ?, ?, ?) ON CONFLICT(run, rank, sender) "
            "DO UPDATE SET floor = max(floor, excluded.floor)",
            (run, rank, sender, floor),
        )

    def load_seqs(self) -> list[tuple[str, int, str, int, list[int]]]:
        """``(run, rank, sender, floor, seqs)``: every seq at or below ``floor`` counts as
        applied (-1: none), and so does each one in ``seqs``."""
        out: dict[tuple[str, int, str], tuple[int, list[int]]] = {}
        with self._lock:
            for run, rank, sender, floor in self._db.execute("SELECT * FROM seq_floors"):
                out[(run, rank, sender)] = (int(floor), [])
            for run, rank, sender, seq in self._db.execute(
                "SELECT run, rank, sender, seq FROM seqs ORDER BY run, rank, sender, seq"
            ):
                out.setdefault((run, rank, sender), (-1, []))[1].append(int(seq))
        return [(run, rank, sender, floor, seqs) for (run, rank, sender), (floor, seqs) in out.items()]
