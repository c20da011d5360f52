"""Encoding request bodies: the one place a ``POST /v1/reports`` body is put together."""

from __future__ import annotations

from collections.abc import Iterable

from trainvitals.wire.schema import SCHEMA_VERSION, Report

__all__ = ["encode_body", "encode_report"]

_HEAD = b'{"schema":%d,"reports":[' % SCHEMA_VERSION
_TAIL = b"]}"


def encode_report(report: Report) -> bytes:
    """One report as wire JSON (non-finite values as ``NaN``/``Infinity``)."""
    return report.model_dump_json(exclude_none=True).encode()


def encode_body(reports: Iterable[bytes]) -> bytes:
    """The body ``{"schema": 1, "reports": [...]}`` around already-encoded reports."""
    return _HEAD + b",".join(reports) + _TAIL
