"""The wire schema: a body is ``{"schema": 1, "reports": [...]}``; see ``docs/wire.md``.

pydantic only (never torch, fastapi or uvicorn): the hooks validate what they
send with it. The collector decodes with a faster decoder of its own
(:mod:`trainvitals.monitor.decode`) that enforces the same rules: the limits
below and :func:`report_problem`, shared by both (a test checks the two agree).

Strict: a number is never read from a string (``"step": "7"``), a bool is not a
number, ``step``/``rank`` are bounded integers, a label value is non-empty
printable text, and event kinds and their labels come from :data:`EVENT_KINDS`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, Strict, StringConstraints, model_validator

from trainvitals.wire.coverage import (
    MAX_COVERAGE_DETAIL,
    MAX_COVERAGE_ENTRIES,
    ReasonName,
    coverage_problem,
)
from trainvitals.wire.metrics import PREFIX, RESERVED_NAMES
from trainvitals.wire.runs import MAX_RUN, RUN_PATTERN, RUN_RULE, SENDER_PATTERN

__all__ = [
    "EVENT_KINDS",
    "HISTOGRAM_LABELS",
    "LABEL_NAME_CONVENTIONS",
    "MAX_EVENTS",
    "MAX_KIND",
    "MAX_LABELS",
    "MAX_LABEL_NAME",
    "MAX_LABEL_VALUE",
    "MAX_RANK",
    "MAX_REPORTS",
    "MAX_RUN",
    "MAX_SAMPLES",
    "MAX_SEQ",
    "MAX_STEP",
    "MAX_TIME",
    "NAME_CONVENTIONS",
    "RESERVED_LABELS",
    "RUN_END_EVENT",
    "RUN_PATTERN",
    "RUN_RULE",
    "SCHEMA_MISSING",
    "SCHEMA_VERSION",
    "SENDER_PATTERN",
    "Coverage",
    "Event",
    "Report",
    "ReportBatch",
    "Sample",
    "SchemaVersion",
    "ends_run",
    "report_problem",
    "schema_version_problem",
]

SchemaVersion = Literal[1]
"""The body format's version as a type: the ``schema`` field of :class:`ReportBatch` and
of the collector's decoder (:mod:`trainvitals.monitor.decode`) are declared with it."""
SCHEMA_VERSION: int = get_args(SchemaVersion)[0]
"""The body format's version (a body is ``{"schema": SCHEMA_VERSION, "reports": [...]}``)."""


def schema_version_problem(body: Any) -> str | None:
    """Why a decoded body's ``schema`` is not :data:`SCHEMA_VERSION`, as a receiver says
    it; None when it is, or when there is no ``schema`` to judge (see
    :data:`SCHEMA_MISSING`: a decoder reports a missing field where it finds it)."""
    if isinstance(body, dict) and "schema" in body and body["schema"] != SCHEMA_VERSION:
        return (
            f"schema: unsupported schema version {body['schema']!r}; this collector supports version {SCHEMA_VERSION}"
        )
    return None


SCHEMA_MISSING = f"schema: missing; this collector supports schema version {SCHEMA_VERSION}"
"""What a receiver says of a body without ``schema``."""

RUN_END_EVENT = "run_end"
"""The event ``Monitor.close()`` sends: the run ended on purpose (no RunSilent for it)."""


def ends_run(report: Any) -> bool:
    """Whether a report ends its run: it carries a :data:`RUN_END_EVENT` (a pydantic
    :class:`Report` or the collector's struct: anything with ``events`` of ``kind``).

    The run end has one meaning on every side (``docs/wire.md``, "The run end"): a run
    has *ended* while its latest report, from any rank, ends it; a later report that
    does not means the run goes on (a job resumed under the same name). So whether a
    run has ended is always ``ends_run(latest report)``, never a flag that stays set."""
    return any(ev.kind == RUN_END_EVENT for ev in report.events)


EVENT_KINDS: Mapping[str, frozenset[str]] = {
    RUN_END_EVENT: frozenset(),
    "optimizer_state_reset": frozenset(),
    "weight_decay_audit": frozenset(),
    "param_series_cut": frozenset(),
    "loss_sample_mixed_modality": frozenset(),
    "loss_unknown_modality_code": frozenset(),
    "modality_without_label_tokens": frozenset({"modality"}),
    "loss_not_cross_entropy": frozenset(),
    "loss_samples_withheld": frozenset(),
    "packing_leak_sign": frozenset({"cause"}),
}
"""The event kinds a report may carry, each with the label names it may have.

Closed: event labels become alert labels, so an open set would let a report name
its own ``alertname``/``severity``/``run`` or create one alert per label value."""

# Labels a sample may not carry: Prometheus renames job/instance on scrape,
# run/rank come from the report itself, alertname/severity identify an alert.
RESERVED_LABELS = frozenset({"job", "instance", "run", "rank", "alertname", "severity"})
MAX_LABELS = 8
MAX_LABEL_NAME = 64
MAX_LABEL_VALUE = 256
MAX_NAME = 128
MAX_REPORTS = 10_000
MAX_SAMPLES = 100_000
"""Samples in one report (the hooks send a few thousand at most)."""
MAX_EVENTS = 64
MAX_KIND = 64
"""Characters of an event kind."""
MAX_DETAIL = 4096
MAX_STEP = 2**53
"""Steps are below 2^53: Prometheus values are float64, exact for integers up to there."""
MAX_RANK = 2**20 - 1
MAX_SEQ = 2**63 - 1
MAX_TIME = 1e11
"""Unix seconds (year 5138): bounds ``time`` to what a float timestamp can mean."""

_NAME = re.compile(r"[a-z_][a-z0-9_]*\Z")
_LABEL_NAME = re.compile(r"(?:[a-zA-Z]|_[a-zA-Z0-9])[a-zA-Z0-9_]*\Z")

# Prometheus's naming conventions, as `promtool check metrics` lints them: a name or a
# label that would put a lint problem on /metrics is refused (promtool is how CI and
# operators check an exporter). Patterns over the wire name (the exposed name is the
# prefix + the wire name), each a word between underscores, shared with the collector's
# OpenAPI schema. Words: units, their prefixes, abbreviations, from promtool's promlint.
_BASE_UNITS = ("amperes", "bytes", "celsius", "grams", "joules", "kelvin", "meters", "metres", "seconds", "volts")
_OTHER_UNITS = {
    "minutes": "seconds",
    "hours": "seconds",
    "days": "seconds",
    "weeks": "seconds",
    "kelvins": "kelvin",
    "fahrenheit": "celsius",
    "rankine": "celsius",
    "inches": "meters",
    "yards": "meters",
    "miles": "meters",
    "bits": "bytes",
    "calories": "joules",
    "pounds": "grams",
    "ounces": "grams",
}
_UNIT_PREFIXES = (
    "pico",
    "nano",
    "micro",
    "milli",
    "centi",
    "deci",
    "deca",
    "hecto",
    "kilo",
    "kibi",
    "mega",
    "mibi",
    "giga",
    "gibi",
    "tera",
    "tebi",
    "peta",
    "pebi",
)
_ABBREVIATIONS = ("s", "ms", "us", "ns", "sec", "b", "kb", "mb", "gb", "tb", "pb", "m", "h", "d")
_TYPES = ("counter", "gauge", "summary", "histogram")  # gauge_histogram: has "gauge" in it
NAME_CONVENTIONS: dict[str, str] = {
    rf"(^|_)({'|'.join(_UNIT_PREFIXES)})({'|'.join((*_BASE_UNITS, *_OTHER_UNITS))})(_|$)": (
        "a unit with a prefix: use the base unit (seconds, bytes, meters, ...) and scale the value"
    ),
    rf"(^|_)({'|'.join(_OTHER_UNITS)})(_|$)": (
        "a unit that is not a base unit: use seconds, bytes, meters, celsius, joules, grams"
    ),
    rf"(^|_)({'|'.join(_ABBREVIATIONS)})(_|$)": "an abbreviated unit: spell the base unit (seconds, bytes)",
    rf"(^|_)({'|'.join(_TYPES)})(_|$)": "a metric type in the name",
    r"(^|_)(count|sum|bucket)$": "a suffix reserved for histograms and summaries",
    r"^total$": "a gauge exposed with a counter's _total suffix",
}
"""Wire-name patterns Prometheus's conventions forbid, each with the reason."""
LABEL_NAME_CONVENTIONS: dict[str, str] = {"[a-z][A-Z]": "camelCase: use snake_case"}
"""Label-name patterns the conventions forbid; ``le`` and ``quantile`` are refused too."""
HISTOGRAM_LABELS = frozenset({"le", "quantile"})
_CONVENTIONS = [(re.compile(p), why) for p, why in NAME_CONVENTIONS.items()]
_LABEL_CONVENTIONS = [(re.compile(p), why) for p, why in LABEL_NAME_CONVENTIONS.items()]
# Names already checked and good (they repeat in every report): a set lookup on the
# hot path instead of a regex. Bounded: cleared when full.
_GOOD_NAMES: set[str] = set()
_GOOD_LABEL_NAMES: set[str] = set()
_CACHE_LIMIT = 100_000


def _name_problem(name: str) -> str | None:
    if not _NAME.match(name):
        return f"{name!r} is not a metric name ([a-z_][a-z0-9_]*)"
    if name.startswith(PREFIX):
        return f"{name!r} must not carry the {PREFIX!r} prefix"
    if name in RESERVED_NAMES:
        return f"metric name {name!r} is produced by the collector; samples may not use it"
    for pattern, why in _CONVENTIONS:
        if pattern.search(name):
            return f"metric name {name!r} breaks a Prometheus naming convention (promtool check metrics): {why}"
    return None


def _label_name_problem(name: str, allowed: frozenset[str] | None) -> str | None:
    if allowed is not None:
        if name not in allowed:
            shown = ", ".join(sorted(allowed)) or "none"
            return f"label {name!r} is not one this event kind carries (allowed: {shown})"
        return None
    if len(name) > MAX_LABEL_NAME or not _LABEL_NAME.match(name):
        return (
            f"label name {name[:80]!r} is not a Prometheus label name (letters, digits, _, "
            f"not starting with a digit or __, at most {MAX_LABEL_NAME} characters)"
        )
    if name in RESERVED_LABELS:
        return (
            f"label {name!r} is reserved (run/rank come from the report; Prometheus renames "
            "job/instance; alertname/severity identify alerts)"
        )
    if name in HISTOGRAM_LABELS:
        return f"label {name!r} is reserved for Prometheus histograms and summaries"
    for pattern, why in _LABEL_CONVENTIONS:
        if pattern.search(name):
            return f"label name {name!r} breaks a Prometheus naming convention: {why}"
    return None


def _value_problem(name: str, value: Any) -> str | None:
    if not isinstance(value, str):
        return f"label {name!r}: value must be a string, got {type(value).__name__}"
    if not value:
        return (
            f"label {name!r}: value is empty (Prometheus reads an empty value as no label, "
            "which would make it another series' duplicate)"
        )
    if len(value) > MAX_LABEL_VALUE:
        return f"label {name!r}: value is {len(value)} characters, over the limit of {MAX_LABEL_VALUE}"
    if not value.isprintable():
        return f"label {name!r}: value {value[:80]!r} contains control or non-printable characters"
    return None


def _labels_problem(labels: Mapping[str, Any], allowed: frozenset[str] | None) -> str | None:
    if len(labels) > MAX_LABELS:
        return f"{len(labels)} labels, over the limit of {MAX_LABELS}"
    good = _GOOD_LABEL_NAMES
    for k, v in labels.items():
        if k not in good or allowed is not None:
            why = _label_name_problem(k, allowed)
            if why is not None:
                return why
            if allowed is None:
                if len(good) >= _CACHE_LIMIT:
                    good.clear()
                good.add(k)
        # Inline the common case (printable, within bounds) before the full check.
        if not (v.__class__ is str and 0 < len(v) <= MAX_LABEL_VALUE and v.isprintable()):
            return _value_problem(k, v)
    return None


def report_problem(samples: Iterable[Any], events: Iterable[Any]) -> str | None:
    """What is wrong with a report's samples and events, as ``path: message``; None if nothing.

    The checks that are not plain types and bounds: metric names (pattern, prefix,
    names the collector exports itself), label names and values, event kinds and
    event labels. Takes any objects with ``name``/``labels`` (samples) and
    ``kind``/``labels`` (events) attributes: pydantic models or the collector's structs,
    whose schemas have checked types and bounds (at most MAX_LABELS labels) first.
    """
    samples = samples if isinstance(samples, list) else list(samples)
    if _samples_fine(samples):
        return _events_problem(events)
    return _report_problem(samples, events)


def _samples_fine(samples: list[Any]) -> bool:
    """The common case, in bulk: every name and label name already checked and good, and
    the label values, all at once, non-empty, short enough and printable. False sends the
    report through the per-sample checks, which name the first problem."""
    good = _GOOD_NAMES
    known_labels = _GOOD_LABEL_NAMES.issuperset
    values: list[str] = []
    extend = values.extend
    for s in samples:
        if s.name not in good:
            return False
        labels = s.labels
        if labels:
            # Both schemas bound the number of labels (MAX_LABELS) before this runs.
            if not known_labels(labels):
                return False
            extend(labels.values())
    if not values:
        return True
    try:
        lengths = list(map(len, values))
        return min(lengths) > 0 and max(lengths) <= MAX_LABEL_VALUE and "".join(values).isprintable()
    except TypeError:  # a value that is not a string: the per-sample checks say which
        return False


def _events_problem(events: Iterable[Any]) -> str | None:
    for i, ev in enumerate(events):
        allowed = EVENT_KINDS.get(ev.kind)
        if allowed is None:
            return f"events.{i}.kind: unknown event kind {ev.kind[:80]!r}; known: {', '.join(sorted(EVENT_KINDS))}"
        if ev.labels:
            why = _labels_problem(ev.labels, allowed)
            if why is not None:
                return f"events.{i}.labels: {why}"
    return None


def _report_problem(samples: list[Any], events: Iterable[Any]) -> str | None:
    """:func:`report_problem`, sample by sample (caching the names found good)."""
    good = _GOOD_NAMES
    for i, s in enumerate(samples):
        name = s.name
        if name not in good:
            why = _name_problem(name)
            if why is not None:
                return f"samples.{i}.name: {why}"
            if len(good) >= _CACHE_LIMIT:
                good.clear()
            good.add(name)
        labels = s.labels
        if labels:
            why = _labels_problem(labels, None)
            if why is not None:
                return f"samples.{i}.labels: {why}"
    return _events_problem(events)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")


# Types and bounds are checked by pydantic-core; names, label names and values by
# report_problem (once per report, cached), so the collector's decoder can share it.
LabelValue = Annotated[str, StringConstraints(min_length=1, max_length=MAX_LABEL_VALUE)]
LabelName = Annotated[str, StringConstraints(min_length=1, max_length=MAX_LABEL_NAME)]
MetricName = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME)]
StrictFloat = Annotated[float, Strict()]


class Sample(_Strict):
    """One value of one series: the metric name without prefix, labels, value."""

    name: MetricName
    labels: Annotated[dict[LabelName, LabelValue], Field(max_length=MAX_LABELS)] = Field(default_factory=dict)
    # NaN/Inf are legal values (a non-finite grad norm is a signal, not an error);
    # strings and bools are not numbers.
    value: StrictFloat


class Event(_Strict):
    """Something that happened once: an optimizer state reset, an audit finding."""

    kind: Annotated[str, Field(min_length=1, max_length=MAX_KIND)]
    detail: Annotated[str, Field(max_length=MAX_DETAIL)] = ""
    labels: Annotated[dict[LabelName, LabelValue], Field(max_length=MAX_LABELS)] = Field(default_factory=dict)


class Coverage(_Strict):
    """One built-in signal's state in a report (:mod:`trainvitals.wire.coverage`): active,
    or inactive with a reason from the closed list and a detail in words."""

    signal: str
    """A registered signal (:mod:`trainvitals.wire.signals`; ``coverage_problem`` checks it
    against the registry, so a signal registered after import is known)."""
    active: Annotated[bool, Strict()]
    reason: ReasonName | None = None
    detail: Annotated[str, Field(max_length=MAX_COVERAGE_DETAIL)] = ""


class Report(_Strict):
    """What one rank knows after one reported optimizer step.

    ``sender`` and ``seq`` (optional) identify the report for idempotent ingest: a
    sender (one per ``Monitor``) numbers its reports, and the collector applies a
    (run, rank, sender, seq) once however often it is retried. ``coverage``: one entry
    per built-in signal, active or why not (absent from older hooks).
    """

    run: Annotated[str, Field(min_length=1, max_length=MAX_RUN, pattern=RUN_PATTERN)]
    step: Annotated[int, Strict(), Field(ge=0, lt=MAX_STEP)]
    time: StrictFloat
    rank: Annotated[int, Strict(), Field(ge=0, le=MAX_RANK)] = 0
    samples: Annotated[list[Sample], Field(max_length=MAX_SAMPLES)] = Field(default_factory=list)
    events: Annotated[list[Event], Field(max_length=MAX_EVENTS)] = Field(default_factory=list)
    coverage: Annotated[list[Coverage], Field(max_length=MAX_COVERAGE_ENTRIES)] = Field(default_factory=list)
    sender: Annotated[str, Field(pattern=SENDER_PATTERN)] | None = None
    seq: Annotated[int, Strict(), Field(ge=0, le=MAX_SEQ)] | None = None

    @model_validator(mode="after")
    def _checks(self) -> Report:
        if not math.isfinite(self.time) or not 0 <= self.time <= MAX_TIME:
            raise ValueError("time: must be a finite Unix timestamp in seconds (0 to 1e11)")
        if (self.sender is None) != (self.seq is None):
            raise ValueError("sender and seq: give both or neither")
        problem = report_problem(self.samples, self.events) or coverage_problem(self.coverage)
        if problem is not None:
            raise ValueError(problem)
        return self


class ReportBatch(_Strict):
    """The body of ``POST /v1/reports``."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, ser_json_inf_nan="constants")

    schema_version: SchemaVersion = Field(alias="schema")
    reports: Annotated[list[Report], Field(min_length=1, max_length=MAX_REPORTS)]
