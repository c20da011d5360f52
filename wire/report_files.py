"""Reading recorded reports: the JSON-lines files a file sink writes, or wire bodies.

The one reader of such files: ``trainvitals check`` and ``trainvitals report`` judge
runs from them (:mod:`trainvitals.alerts.verdict`) and ``trainvitals replay`` sends
them to a collector. A line is either a wire body ``{"schema": 1, "reports": [...]}``
or a single report (:func:`parse_line`); :func:`read_report_file` yields each report
with its line number and :class:`ReportFileError` names the file and the first line
that is not a trainvitals report, and why.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from trainvitals.wire.body import encode_body
from trainvitals.wire.errors import ConfigurationError
from trainvitals.wire.schema import Report, ReportBatch

__all__ = [
    "ReportFileError",
    "first_error",
    "is_body",
    "line_as_body",
    "parse_line",
    "read_report_file",
    "read_report_files",
]


class ReportFileError(ConfigurationError):
    """A report file that cannot be read; the message names the file and the line.

    ``where``: ``PATH`` or ``PATH:LINE``; ``reason``: what is wrong there, in words."""

    def __init__(self, where: str, reason: str, message: str | None = None) -> None:
        super().__init__(message or f"{where}: {reason}")
        self.where = where
        self.reason = reason


def is_body(obj: Any) -> bool:
    """Whether a decoded line is a wire body (it has ``reports``), not a single report."""
    return isinstance(obj, Mapping) and "reports" in obj


def line_as_body(line: bytes) -> bytes:
    """One JSON line as a wire body, without decoding it: a body as it is, a single
    report wrapped in one (:func:`~trainvitals.wire.body.encode_body`)."""
    stripped = line.strip()
    if stripped.startswith(b"{") and b'"reports"' not in stripped[:200]:
        return encode_body([stripped])
    return stripped


def parse_line(obj: Any) -> list[Report]:
    """The reports of one decoded JSON line: a wire body's, or the line as one report.
    A pydantic ``ValidationError`` (a ValueError) when it is neither."""
    if is_body(obj):
        return list(ReportBatch.model_validate(obj).reports)
    return [Report.model_validate(obj)]


def first_error(exc: ValueError) -> str:
    """A validation error in a line: its first three problems, each with where."""
    errors = getattr(exc, "errors", None)
    if errors is None:
        return str(exc)
    errs = errors(include_url=False)
    parts = [
        f"{'.'.join(str(p) for p in e['loc']) or 'line'}: {e['msg'].removeprefix('Value error, ')}" for e in errs[:3]
    ]
    return "; ".join(parts) + (f"; ... and {len(errs) - 3} more" if len(errs) > 3 else "")


def read_report_file(path: str | Path, decode: Callable[[bytes], list[Any]] | None = None) -> Iterator[tuple[int, Any]]:
    """(line number, report) for each report of a JSONL file (a file sink's, or wire
    bodies one per line); :class:`ReportFileError` names the first bad line.

    ``decode``: a faster decoder of one line into reports with the wire models'
    attributes (the collector's); a line it refuses is read again by the wire models,
    whose message names the problem."""
    path = Path(path)
    try:
        fh = path.open(encoding="utf-8")
    except OSError as exc:
        raise ReportFileError(str(path), f"cannot read it: {exc.strerror or exc}") from None
    with fh:
        try:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                if decode is not None:
                    try:
                        fast = decode(line.encode())
                    except ValueError:
                        pass  # the wire models say what is wrong, below
                    else:
                        for report in fast:
                            yield lineno, report
                        continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(line)
                except ValueError as exc:
                    raise ReportFileError(where, f"not valid JSON: {exc}") from None
                try:
                    reports = parse_line(obj)
                except ValueError as exc:  # pydantic.ValidationError
                    reason = first_error(exc)
                    raise ReportFileError(where, reason, f"{where}: not a trainvitals report: {reason}") from None
                for report in reports:
                    yield lineno, report
        except UnicodeDecodeError as exc:
            raise ReportFileError(str(path), f"not a text file of JSON lines ({exc.reason})") from None


def read_report_files(paths: Iterable[str | Path], decode: Callable[[bytes], list[Any]] | None = None) -> Iterator[Any]:
    """Every report of every file, in file order."""
    for p in paths:
        for _, report in read_report_file(p, decode):
            yield report
