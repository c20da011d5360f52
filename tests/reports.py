"""Test data builders: wire samples, reports and bodies as plain dicts (what a client
would POST), and the same validated into the wire models (what the collector's store
and the alert engine take)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from trainvitals.wire import SCHEMA_VERSION, Report, ReportBatch

__all__ = ["make_batch", "make_body", "make_report", "make_sample", "wire_report"]


def make_sample(name: str, value: float, **labels: str) -> dict[str, Any]:
    """One wire sample as a dict."""
    return {"name": name, "labels": labels, "value": value}


def make_report(
    run: str = "r1",
    step: int = 1,
    samples: list[dict[str, Any]] | None = None,
    *,
    rank: int = 0,
    events: list[dict[str, Any]] | None = None,
    time: float = 1_764_400_000.0,
) -> dict[str, Any]:
    """One wire report as a dict; by default a single ``loss{modality="text"}`` sample."""
    if samples is None:
        samples = [make_sample("loss", 2.5, modality="text")]
    return {
        "run": run,
        "step": step,
        "time": time,
        "rank": rank,
        "samples": samples,
        "events": events or [],
    }


def make_body(*reports: dict[str, Any]) -> dict[str, Any]:
    """A wire body (``{"schema": 1, "reports": [...]}``) around ``reports``."""
    return {"schema": SCHEMA_VERSION, "reports": list(reports) if reports else [make_report()]}


def make_batch(*reports: dict[str, Any]) -> ReportBatch:
    """:func:`make_body` validated: what ``POST /v1/reports`` hands the store."""
    return ReportBatch.model_validate(make_body(*reports))


def wire_report(
    step: int,
    samples: Iterable[tuple[str, dict[str, str], float]] = (),
    *,
    run: str = "r1",
    rank: int = 0,
    events: Iterable[str | tuple[str, str]] = (),
    time: float | None = None,
) -> Report:
    """A validated wire Report from (name, labels, value) triples and event kinds (or
    (kind, detail) pairs); its time is ``1000 + step`` unless given."""
    return Report.model_validate(
        make_report(
            run,
            step,
            [{"name": n, "labels": dict(lb), "value": v} for n, lb, v in samples],
            rank=rank,
            events=[{"kind": e} if isinstance(e, str) else {"kind": e[0], "detail": e[1]} for e in events],
            time=1000.0 + step if time is None else time,
        )
    )
