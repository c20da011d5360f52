"""Shared by the ``trainvitals run`` / ``configure`` tests: a real collector that records
every report it applies, and the ``trainvitals`` command run on the scripts in ``jobs/``
(plain PyTorch scripts that know nothing of trainvitals)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support import Collector, running_collector

JOBS = Path(__file__).resolve().parent / "jobs"
TRAINVITALS = str(Path(sys.executable).with_name("trainvitals"))


@dataclass
class Got:
    """One report as the collector applied it."""

    run: str
    step: int
    rank: int
    received: float  # collector clock, Unix seconds
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)

    def value(self, name: str, **labels: str) -> float | None:
        return self.samples.get((name, frozenset(labels.items())))

    def labels_of(self, name: str, key: str) -> set[str]:
        return {dict(labels)[key] for n, labels in self.samples if n == name and key in dict(labels)}

    @property
    def names(self) -> set[str]:
        return {n for n, _ in self.samples}


class Recorder:
    """The reports a collector applied, in order (duplicates are never applied)."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector
        self.reports: list[Got] = []
        self._lock = threading.Lock()
        collector.app.state.store.on_ingest(self._seen)

    def _seen(self, batch: Any, now: float) -> None:
        with self._lock:
            for r in batch.reports:
                self.reports.append(
                    Got(
                        r.run,
                        r.step,
                        r.rank,
                        now,
                        {(s.name, frozenset(s.labels.items())): s.value for s in r.samples},
                        [e.kind for e in r.events],
                    )
                )

    def of(self, run: str, rank: int | None = None) -> list[Got]:
        """The run's step reports (not the run_end report ``close()`` sends)."""
        with self._lock:
            return [
                g
                for g in self.reports
                if g.run == run and "run_end" not in g.events and (rank is None or g.rank == rank)
            ]

    def steps(self, run: str, rank: int | None = None) -> list[int]:
        return [g.step for g in self.of(run, rank)]

    def ended(self, run: str) -> bool:
        with self._lock:
            return any(g.run == run and "run_end" in g.events for g in self.reports)


@contextmanager
def recording_collector(**fields: Any) -> Iterator[Recorder]:
    """A real collector on loopback (state in memory unless ``state_path`` is given)."""
    fields.setdefault("state_path", None)
    with running_collector(**fields) as collector:
        yield Recorder(collector)


def job_env(**extra: str) -> dict[str, str]:
    """This environment (the suite has removed TRAINVITALS_* from it) plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINVITALS_")}
    env.update(extra)
    return env


def trainvitals(
    *args: str, env: dict[str, str] | None = None, cwd: Path = JOBS, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """``trainvitals ARGS`` to completion (output captured)."""
    return subprocess.run(
        [TRAINVITALS, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env if env is not None else job_env(),
        timeout=timeout,
    )


def printed(stdout: str, step: int, key: str) -> float:
    """A figure the plain job printed for ``step`` (``step N key value ...``)."""
    for line in stdout.splitlines():
        words = line.split()
        if words[:2] == ["step", str(step)] and key in words:
            return float(words[words.index(key) + 1])
    raise AssertionError(f"the job printed no {key} for step {step}:\n{stdout}")


def finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)
