"""Live settings per run: what ``trainvitals configure`` (``PUT /v1/runs/{run}/settings``)
asked of a running job, until when.

The collector answers each accepted report batch with the settings of the batch's
runs (``docs/wire.md``, "Live settings"); the job's hooks apply them at their next
step. Every entry expires (``ttl_seconds``, 1 h by default, at most 7 days): a
forgotten ``--every 1`` goes back to the job's own settings by itself, and the
hooks keep the same deadline on their side, so it also ends when the collector is
gone. With ``state_path`` the entries survive a restart of the collector.
"""

from __future__ import annotations

import builtins
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from trainvitals.wire.live_settings import (
    BUILTIN_SIGNALS,
    DEFAULT_TTL_SECONDS,
    LIVE_FIELDS,
    MAX_INTERVAL,
    MAX_TTL_SECONDS,
    SettingsRequest,
    parse_request,
)

__all__ = [
    "BUILTIN_SIGNALS",
    "DEFAULT_TTL_SECONDS",
    "LIVE_FIELDS",
    "MAX_INTERVAL",
    "MAX_TTL_SECONDS",
    "RunSettings",
    "RunSettingsTable",
    "SettingsRequest",
    "parse_request",
]


@dataclass(frozen=True)
class RunSettings:
    """One run's live settings: the override, when set and until when (Unix seconds)."""

    values: dict[str, Any]
    set_at: float
    expires_at: float

    def answer(self, now: float) -> dict[str, Any]:
        """The entry sent to the job: the override and the seconds it has left (relative,
        so the job's clock does not matter)."""
        return {**self.values, "expires_in": round(max(self.expires_at - now, 0.0), 3)}

    def public(self, now: float) -> dict[str, Any]:
        """What ``/v1/runs`` and the settings endpoints show."""
        return {
            **self.values,
            "set_at": self.set_at,
            "expires_at": self.expires_at,
            "expires_in": round(max(self.expires_at - now, 0.0), 3),
        }


class RunSettingsTable:
    """The live settings of every run; thread-safe. ``state`` (a
    :class:`~trainvitals.monitor.state_db.StateDB`) keeps them across restarts."""

    def __init__(self, state: Any = None, *, clock: Any = time.time) -> None:
        self._state = state
        self._clock = clock
        self._lock = threading.Lock()
        self._runs: dict[str, RunSettings] = {}
        if state is not None:
            now = clock()
            for run, values, set_at, expires_at in state.load_run_settings():
                if expires_at > now:
                    self._runs[run] = RunSettings(values, set_at, expires_at)
                else:
                    self._delete(run)

    def _delete(self, run: str) -> None:
        """Forget the run's row in the state file; a failed write is logged and counted
        there, and the row is harmless (it is dropped again at the next start)."""
        if self._state is None:
            return
        try:
            self._state.delete_run_settings(run)
        except OSError:
            pass

    def forget(self, run: str, set_before: float) -> None:
        """The run is new to the collector since ``set_before`` (first report, or after it
        expired): a new job under an old run's name starts with its own settings, not the
        old job's. Settings put after that moment (for the new job) stay."""
        if self._runs:
            with self._lock:
                had = self._runs.get(run)
                if had is not None and had.set_at < set_before:
                    del self._runs[run]
                else:
                    had = None
            if had is not None:
                self._delete(run)

    def set(self, run: str, values: dict[str, Any], ttl_seconds: float) -> RunSettings:
        now = self._clock()
        entry = RunSettings(dict(values), now, now + ttl_seconds)
        if self._state is not None:
            self._state.save_run_settings(run, entry.values, entry.set_at, entry.expires_at)
        with self._lock:
            self._runs[run] = entry
        return entry

    def clear(self, run: str) -> bool:
        """Back to the job's own settings; False when the run had none."""
        with self._lock:
            had = self._runs.pop(run, None)
        if had is not None:
            self._delete(run)
        return had is not None

    def get(self, run: str) -> RunSettings | None:
        """The run's settings, or None (none set, or expired)."""
        if not self._runs:
            return None
        return self._live({run}, self._clock()).get(run)

    def answer(self, runs: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The ``settings`` part of the answer to a batch from ``runs``: an entry per
        run that has live settings (none: the job uses its own)."""
        if not self._runs:  # the common case, without a lock or a clock read
            return {}
        now = self._clock()
        return {run: s.answer(now) for run, s in self._live(set(runs), now).items()}

    # builtins.set: inside this class body ``set`` is the method above, not the builtin.
    def _live(self, runs: builtins.set[str], now: float) -> dict[str, RunSettings]:
        expired = []
        out = {}
        with self._lock:
            for run in runs:
                s = self._runs.get(run)
                if s is None:
                    continue
                if s.expires_at <= now:
                    del self._runs[run]
                    expired.append(run)
                else:
                    out[run] = s
        for run in expired:
            self._delete(run)
        return out
