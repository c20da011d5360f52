"""Test data builders: wire reports and bodies as plain dicts (what a client would POST)."""

from __future__ import annotations

from typing import Any

from trainvitals.wire import SCHEMA_VERSION

__all__ = ["make_body", "make_report"]


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
        samples = [{"name": "loss", "labels": {"modality": "text"}, "value": 2.5}]
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
