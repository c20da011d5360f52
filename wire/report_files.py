"""Reading recorded reports: the JSON-lines files a file sink writes, or wire bodies.

``trainvitals check`` and ``trainvitals report`` judge runs from such files
(:mod:`trainvitals.alerts.verdict`); :func:`read_report_file` yields each report with
its line number and :class:`ReportFileError` names the file and the first line that
is not a trainvitals report, and why.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from trainvitals.wire import Report, ReportBatch
from trainvitals.wire.errors import ConfigurationError

__all__ = ["ReportFileError", "first_error", "read_report_file", "read_report_files"]


class ReportFileError(ConfigurationError):
    """A report file that cannot be read; the message names the file and the line."""


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
        raise ReportFileError(f"{path}: cannot read it: {exc.strerror or exc}") from None
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
                try:
                    obj = json.loads(line)
                except ValueError as exc:
                    raise ReportFileError(f"{path}:{lineno}: not valid JSON: {exc}") from None
                try:
                    if isinstance(obj, Mapping) and "reports" in obj:
                        reports = list(ReportBatch.model_validate(obj).reports)
                    else:
                        reports = [Report.model_validate(obj)]
                except ValueError as exc:  # pydantic.ValidationError
                    raise ReportFileError(f"{path}:{lineno}: not a trainvitals report: {first_error(exc)}") from None
                for report in reports:
                    yield lineno, report
        except UnicodeDecodeError as exc:
            raise ReportFileError(f"{path}: not a text file of JSON lines ({exc.reason})") from None


def read_report_files(paths: Iterable[str | Path], decode: Callable[[bytes], list[Any]] | None = None) -> Iterator[Any]:
    """Every report of every file, in file order."""
    for p in paths:
        for _, report in read_report_file(p, decode):
            yield report
