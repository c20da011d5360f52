"""What a report looks like to the code that reads it, whichever decoder made it.

A report reaches the store and the alert engine as the wire's pydantic models
(:class:`~trainvitals.wire.schema.Report`, from the hooks or a replay) or as the
collector decoder's msgspec structs (the ingest route). Both have these attributes;
the readers type against these protocols, so neither side imports the other's types.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

__all__ = ["BatchView", "CoverageView", "EventView", "ReportView", "SampleView"]


class SampleView(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def labels(self) -> Mapping[str, str]: ...
    @property
    def value(self) -> float: ...


class EventView(Protocol):
    @property
    def kind(self) -> str: ...
    @property
    def detail(self) -> str: ...
    @property
    def labels(self) -> Mapping[str, str]: ...


class CoverageView(Protocol):
    @property
    def signal(self) -> str: ...
    @property
    def active(self) -> bool: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def detail(self) -> str: ...


class ReportView(Protocol):
    @property
    def run(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def time(self) -> float: ...
    @property
    def rank(self) -> int: ...
    @property
    def samples(self) -> Sequence[SampleView]: ...
    @property
    def events(self) -> Sequence[EventView]: ...
    @property
    def coverage(self) -> Sequence[CoverageView]: ...
    @property
    def sender(self) -> str | None: ...
    @property
    def seq(self) -> int | None: ...


class BatchView(Protocol):
    """The reports of one ingested body (what the store's ``on_ingest`` callbacks get)."""

    @property
    def reports(self) -> Sequence[ReportView]: ...
