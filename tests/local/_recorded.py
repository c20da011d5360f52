"""Report files recorded from the incident jobs (tests/e2e/_jobs.py), written the way
a job with no collector writes them: ``attach(sink="file:...")``, a report every step."""

from __future__ import annotations

from pathlib import Path

from tests.e2e._jobs import (
    AccumulationJob,
    DilutionJob,
    DistillJob,
    DriftJob,
    HealthyJob,
    Job,
    MeanOfMeansJob,
    SpikeJob,
)
from tests.support import one_torch_thread
from trainvitals.hooks import attach

# name -> (job class, optimizer steps): enough for the alert to fire (every step) with a margin.
RECORDINGS: dict[str, tuple[type[Job], int]] = {
    "i1": (DilutionJob, 24),
    "i2": (AccumulationJob, 24),
    "i3": (MeanOfMeansJob, 54),
    "i4": (DriftJob, 56),
    "i5": (DistillJob, 54),
    "healthy": (HealthyJob, 30),
    "spike": (SpikeJob, 40),  # GradNormSpike: the gradient 100x at step 27
}


def record(folder: Path, name: str, *, fixed: bool = False) -> Path:
    """Train the job of ``name`` and return its report file (run ``name``)."""
    cls, steps = RECORDINGS[name]
    path = folder / f"{name}{'-fixed' if fixed else ''}.jsonl"
    job = cls(fixed=fixed)
    with one_torch_thread():
        mon = attach(job.model, job.opt, run=name, sink=f"file:{path}", modalities=job.modalities, every=1, rules="off")
        job.train(mon, steps)
        mon.close()
    return path
