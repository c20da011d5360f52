"""Per-run data other collector parts keep in the state file: each run's first drift
references (:mod:`trainvitals.monitor.lifetime`), kept while the run reports within 30
days so ParamDrift judges a resumed run's whole life, and the live settings
(:mod:`trainvitals.monitor.run_settings`, ``trainvitals configure``): per run, what was
set and until when, so a restart neither drops nor extends them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from trainvitals.monitor.state_writes import StateWriteError, StateWrites

__all__ = ["RunDataTables"]


class RunDataTables(StateWrites):
    """Drift references and live settings, per run."""

    # -- drift references --------------------------------------------------------

    def load_drift_refs(self, since: float) -> list[tuple[str, int, str, float, float]]:
        """``(run, rank, param, ref, scale)`` of the runs seen since ``since`` (older ones are
        deleted)."""
        try:
            self._tx(
                "drift_refs",
                lambda: (
                    self._db.execute(
                        "DELETE FROM drift_refs WHERE run IN (SELECT run FROM drift_runs WHERE seen < ?)", (since,)
                    ),
                    self._db.execute("DELETE FROM drift_runs WHERE seen < ?", (since,)),
                ),
            )
        except StateWriteError:
            pass  # counted and logged; what is there is still read
        with self._lock:
            rows = self._db.execute("SELECT run, rank, param, ref, scale FROM drift_refs").fetchall()
        return [(r, int(k), p, float(v), float(sc)) for r, k, p, v, sc in rows]

    def save_drift_refs(
        self, refs: Iterable[tuple[str, int, str, float, float, float]], runs: Iterable[str], now: float
    ) -> None:
        """Keep first references ``(run, rank, param, ref, scale, now)`` (a kept one is not
        replaced) and mark ``runs`` seen at ``now``."""
        refs, runs = list(refs), sorted(set(runs) | {r[0] for r in refs})

        def body() -> None:
            self._db.executemany(
                "INSERT OR IGNORE INTO drift_refs VALUES (?, ?, ?, ?, ?)",
                [(r, k, p, v, sc) for r, k, p, v, sc, _ in refs],
            )
            self._db.executemany(
                "INSERT INTO drift_runs VALUES (?, ?) ON CONFLICT(run) DO UPDATE SET seen = excluded.seen",
                [(run, now) for run in runs],
            )

        try:
            self._tx("drift_refs", body)
        except StateWriteError:
            pass  # counted and logged by _tx; the references stay in memory

    # -- live settings -----------------------------------------------------------

    def load_run_settings(self) -> list[tuple[str, dict[str, Any], float, float]]:
        """``(run, settings, set_at, expires_at)`` for every run's live settings kept."""
        with self._lock:
            rows = self._db.execute("SELECT run, data, set_at, expires_at FROM run_settings").fetchall()
        return [(r, json.loads(d), float(s), float(e)) for r, d, s, e in rows]

    def save_run_settings(self, run: str, settings: Mapping[str, Any], set_at: float, expires_at: float) -> None:
        self._write(
            "INSERT INTO run_settings VALUES (?, ?, ?, ?) ON CONFLICT(run) DO UPDATE SET "
            "data = excluded.data, set_at = excluded.set_at, expires_at = excluded.expires_at",
            [(run, json.dumps(dict(settings)), set_at, expires_at)],
            "run_settings",
        )

    def delete_run_settings(self, run: str) -> None:
        self._write("DELETE FROM run_settings WHERE run = ?", [(run,)], "run_settings")
