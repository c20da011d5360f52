"""The collector's wire decoder: JSON bytes -> validated report structs, fast.

The rules are the wire schema's (:mod:`trainvitals.wire.schema`: the same limits,
and :func:`~trainvitals.wire.schema.report_problem` for names, labels and event
kinds); this module only makes them cheap. msgspec decodes straight into
structs (about 0.5 us per sample against 2.5 us for the pydantic models), and
the name checks hit caches since names repeat in every report.

Labels repeat in every report (the same parameters, the same modalities), so the fast
path reads each sample's labels as raw JSON text and looks the text up: every spelling
is decoded and checked once, and all its samples share one read-only
:class:`~trainvitals.monitor.series.Labels` carrying the store's key for it (the store
then does no per-sample key building). Names that passed the checks are remembered the
same way. A spelling or a name seen for the first time sends the report through the
wire's checks (:func:`~trainvitals.wire.schema.report_problem`) before it is remembered.

msgspec reads standard JSON only, and the wire writes non-finite values as
``NaN``/``Infinity``: a body the fast path cannot take (those tokens, an integer
written ``7.0``, or any error) is decoded again by the reference path, ``json.loads`` then
``msgspec.convert`` into the same structs, whose answer (and error message)
is the one that counts. The structs have the attributes of the pydantic
models (``report.run``, ``sample.labels``, ...), so the store and the alert
engine take either.
"""

from __future__ import annotations

import json
import math
import re
from operator import attrgetter
from typing import Annotated

import msgspec
from msgspec import UNSET, Meta, Raw, UnsetType

from trainvitals.monitor.series import Labels
from trainvitals.wire.coverage import MAX_COVERAGE_DETAIL, MAX_COVERAGE_ENTRIES, ReasonName, coverage_problem
from trainvitals.wire.errors import Refused
from trainvitals.wire.runs import MAX_RUN, RUN_REGEX, SENDER_REGEX
from trainvitals.wire.schema import (
    MAX_DETAIL,
    MAX_EVENTS,
    MAX_KIND,
    MAX_LABEL_NAME,
    MAX_LABELS,
    MAX_NAME,
    MAX_RANK,
    MAX_REPORTS,
    MAX_SAMPLES,
    MAX_SEQ,
    MAX_STEP,
    MAX_TIME,
    SCHEMA_MISSING,
    SchemaVersion,
    report_problem,
    schema_version_problem,
)

__all__ = ["BodyInvalid", "WireBatch", "WireCoverage", "WireEvent", "WireReport", "WireSample", "decode_batch"]

# msgspec matches patterns with Python's re.search: the wire's Python forms (\A...\Z), so
# "r1\n" is refused as the pydantic models refuse it.
_LabelName = Annotated[str, Meta(min_length=1, max_length=MAX_LABEL_NAME)]
# Label values: empty, too long or unprintable is checked by report_problem (naming the label).
_Labels = Annotated[dict[_LabelName, str], Meta(max_length=MAX_LABELS)]


class WireSample(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """A sample as the collector holds it (attributes as :class:`trainvitals.wire.Sample`)."""

    name: Annotated[str, Meta(min_length=1, max_length=MAX_NAME)]
    value: float  # an int is a number too; a string or a bool is not
    labels: _Labels = {}


class WireEvent(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    kind: Annotated[str, Meta(min_length=1, max_length=MAX_KIND)]
    detail: Annotated[str, Meta(max_length=MAX_DETAIL)] = ""
    labels: _Labels = {}


class WireCoverage(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """A coverage entry (attributes as :class:`trainvitals.wire.Coverage`)."""

    signal: str  # a registered signal: coverage_problem checks it against the registry
    active: bool
    reason: ReasonName | None = None
    detail: Annotated[str, Meta(max_length=MAX_COVERAGE_DETAIL)] = ""


class WireReport(msgspec.Struct, forbid_unknown_fields=True):
    run: Annotated[str, Meta(min_length=1, max_length=MAX_RUN, pattern=RUN_REGEX)]
    step: Annotated[int, Meta(ge=0, lt=MAX_STEP)]
    time: float
    rank: Annotated[int, Meta(ge=0, le=MAX_RANK)] = 0
    samples: Annotated[list[WireSample], Meta(max_length=MAX_SAMPLES)] = []
    events: Annotated[list[WireEvent], Meta(max_length=MAX_EVENTS)] = []
    coverage: Annotated[list[WireCoverage], Meta(max_length=MAX_COVERAGE_ENTRIES)] = []
    sender: Annotated[str, Meta(pattern=SENDER_REGEX)] | None = None
    seq: Annotated[int, Meta(ge=0, le=MAX_SEQ)] | None = None


class WireBatch(msgspec.Struct, forbid_unknown_fields=True, rename={"schema_version": "schema"}):
    schema_version: SchemaVersion
    reports: Annotated[list[WireReport], Meta(min_length=1, max_length=MAX_REPORTS)]


class BodyInvalid(Refused, ValueError):
    """A body that is not a valid wire body: 422 naming the field, or 400 when it is not
    JSON at all (``json_ok`` False)."""

    def __init__(self, message: str, *, json_ok: bool = True) -> None:
        super().__init__(message, status=422 if json_ok else 400)
        self.json_ok = json_ok


class _FastSample(WireSample, forbid_unknown_fields=True, gc=False):
    """A sample as the fast path reads it: its labels as JSON text, until :func:`_share`
    puts the shared :class:`Labels` in their place."""

    labels: Raw | UnsetType = UNSET  # type: ignore[assignment]


class _FastReport(WireReport, forbid_unknown_fields=True):
    samples: Annotated[list[_FastSample], Meta(max_length=MAX_SAMPLES)] = []  # type: ignore[assignment]


class _FastBatch(WireBatch, forbid_unknown_fields=True, rename={"schema_version": "schema"}):
    reports: Annotated[list[_FastReport], Meta(min_length=1, max_length=MAX_REPORTS)]  # type: ignore[assignment]


_DECODER = msgspec.json.Decoder(WireBatch)
_FAST = msgspec.json.Decoder(_FastBatch)
_LABELS = msgspec.json.Decoder(_Labels)
_NO_LABELS = Labels({})
# Label spellings (JSON text) decoded and checked -> their shared Labels, and the sample
# names checked: both bounded (cleared when full; what follows is checked again).
_KNOWN_LABELS: dict[bytes, Labels] = {}
_KNOWN_NAMES: set[str] = set()
_CACHE_LIMIT = 65_536
_NAME_OF = attrgetter("name")
_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def decode_batch(body: bytes) -> WireBatch:
    """Validate a wire body; raise :class:`BodyInvalid` naming the first bad field."""
    try:
        fast = _FAST.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError):
        # The fast structs take more than the others (labels as any JSON text), so the
        # others refuse this body too: the reference decode says why, or takes it.
        batch = _reference(body)
    else:
        shared = _share(fast)
        if shared is not None:
            fresh, names_known = shared
            try:
                _check(fast, known=names_known and not fresh)
            except BodyInvalid:
                pass  # the answer is the full decode's (below)
            else:
                if fresh or not names_known:
                    _remember(fast, fresh)
                return fast
        try:
            batch = _DECODER.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError):
            batch = _reference(body)
    _check(batch)
    return batch


def _share(batch: _FastBatch) -> tuple[dict[bytes, Labels], bool] | None:
    """Put the shared :class:`Labels` of each sample's spelling in place of its text.
    Returns the spellings not seen before (decoded here, their checks still to run) and
    whether every sample name passed the checks before; None when some labels are not a
    valid labels object (the full decode says why)."""
    known = _KNOWN_LABELS
    fresh: dict[bytes, Labels] = {}
    for report in batch.reports:
        for s in report.samples:
            raw = s.labels
            if raw is UNSET:
                s.labels = _NO_LABELS  # type: ignore[assignment]
                continue
            text = bytes(raw)
            labels = known.get(text)
            if labels is None:
                labels = fresh.get(text)
                if labels is None:
                    try:
                        labels = fresh[text] = Labels(_LABELS.decode(text))
                    except (msgspec.ValidationError, msgspec.DecodeError):
                        return None
            s.labels = labels  # type: ignore[assignment]
    names = _KNOWN_NAMES.issuperset
    return fresh, all(names(map(_NAME_OF, r.samples)) for r in batch.reports)


def _remember(batch: WireBatch, fresh: dict[bytes, Labels]) -> None:
    """The spellings and names of a batch that passed the checks."""
    if len(_KNOWN_LABELS) + len(fresh) > _CACHE_LIMIT:
        _KNOWN_LABELS.clear()
    _KNOWN_LABELS.update(fresh)
    names = {s.name for r in batch.reports for s in r.samples}
    if len(_KNOWN_NAMES) + len(names) > _CACHE_LIMIT:
        _KNOWN_NAMES.clear()
    _KNOWN_NAMES.update(names)


def _whole(text: str) -> float | int:
    """A JSON number with a fraction: a float, or the integer it spells exactly (``7.0``).

    JSON Schema counts ``7.0`` as the integer 7 (and so do OpenAPI clients generated
    from ``/openapi.json``): integer fields take it. Values stay numbers either way.
    """
    value = float(text)
    return int(value) if value.is_integer() and abs(value) <= _EXACT else value


_EXACT = 2**53  # floats spell every integer up to here exactly


def _reference(body: bytes) -> WireBatch:
    """The reference decode (NaN/Infinity tokens, integers written ``7.0``, and every
    error message)."""
    try:
        obj = json.loads(body, parse_float=_whole)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise BodyInvalid(f"body is not valid JSON: {exc}", json_ok=False) from None
    problem = schema_version_problem(obj)
    if problem is not None:
        raise BodyInvalid(problem)
    try:
        return msgspec.convert(obj, WireBatch, strict=True)
    except msgspec.ValidationError as exc:
        raise BodyInvalid(_describe(str(exc))) from None


def _describe(message: str) -> str:
    """msgspec's ``Expected `int`, got `str` - at `$.reports[0].step``` as ``reports.0.step: ...``."""
    m = _AT.match(message)
    assert m is not None
    msg, path = m.group("msg"), m.group("path") or ""
    path = re.sub(r"\[(\d+)\]", r".\1", path).lstrip(".")
    path = re.sub(r"\['([^']*)'\]", r".\1", path)
    if msg == "Object missing required field `schema`" and not path:
        return SCHEMA_MISSING
    return f"{path or 'body'}: {msg}"


def _check(batch: WireBatch, *, known: bool = False) -> None:
    """The checks beyond types and bounds, per report (shared with the pydantic models).
    ``known``: every sample's name and labels passed them before (only the events and the
    coverage are checked)."""
    for i, r in enumerate(batch.reports):
        t = r.time
        if not (0.0 <= t <= MAX_TIME) or math.isnan(t):
            raise BodyInvalid(f"reports.{i}.time: must be a finite Unix timestamp in seconds (0 to 1e11)")
        if (r.sender is None) != (r.seq is None):
            raise BodyInvalid(f"reports.{i}: sender and seq: give both or neither")
        problem = report_problem(() if known else r.samples, r.events) or (
            coverage_problem(r.coverage) if r.coverage else None
        )
        if problem is not None:
            raise BodyInvalid(f"reports.{i}.{problem}")
