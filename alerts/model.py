"""The rule model: what one alert rule is, validated with pydantic.

Three kinds, told apart by the key that names what they watch (the full format,
with every field, is in ``docs/rules.md``)::

    - alert: GradientDilution              # unique name (the `alertname` label)
      metric: modality_dilution_ratio      # wire name, without the trainvitals_ prefix
      labels: {modality: "!=text"}         # matchers: value (equal), "!=v", "=~regex", "!~regex"
      above: 5                             # or `below:`; fires past it (strictly)
      clear: 3                             # hysteresis: resolves only back at/below this
      transform: value                     # or `increase` (counters: the increase since the
                                           # series' previous report) or `ratio_to_median`
                                           # (value / median of its previous `window` reports,
                                           # judged from `min_history` reports on)
      and:                                 # further conditions on the same series' labels
        - {metric: param_weight_decay, below: 1.0e-12}
      for_steps: 20                        # optimizer steps past the threshold before firing
      for: 5m                              # and/or time (s, m, h, d; or seconds)
      hold_steps: 0                        # keep firing this long after clearing
      hold: 0s
      severity: page                       # critical|page|error|warning|ticket|info
      summary: "{modality} gets {value:.1f}x less gradient in run {run}"
      description: "..."                   # str.format over labels, value, alertname,
                                           # severity, step, above, below, clear
      runbook: "RUNBOOKS.md#gradientdilution"

    - alert: OptimizerStateReset
      event: optimizer_state_reset         # fires on the report carrying the event
      hold_steps: 100                      # resolves after this many steps without one
      summary: "reset at step {step}: {detail}"

    - alert: RunSilent
      silent_for: 10m                      # fires when a run has not reported this long
      summary: "run {run} silent for {value:.0f} s"

A check that belongs to one field raises :class:`FieldError`, so that the loader
(:mod:`trainvitals.alerts.loading`) can name the field in its message. Which
labels a metric's series carry comes from the wire's metric table
(``docs/metrics.md``).
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from trainvitals.alerts.templates import RULE_FIELDS, check_template
from trainvitals.wire import METRICS, PREFIX, labels_of, series_labels
from trainvitals.wire.errors import ConfigurationError

__all__ = [
    "EVENT_COUNTERS",
    "KINDS",
    "KNOWN_LABELS",
    "METRIC_LABELS",
    "RULE_TYPES",
    "SERIES_LABELS",
    "Condition",
    "EventRule",
    "FieldError",
    "Matcher",
    "Rule",
    "SilenceRule",
    "ThresholdRule",
    "parse_duration",
    "series_label_sets",
]

Severity = Literal["critical", "page", "error", "warning", "ticket", "info"]

# The labels every series of a run carries before its own: `run`, and `rank`
# (left out on rank 0), as the wire's series_labels writes them.
SERIES_LABELS: tuple[str, ...] = tuple(series_labels("", 1, {}))
# Labels each metric of a run carries besides SERIES_LABELS, from the wire's metric
# table: the hooks' metrics and the collector's per-run gauges (the collector's
# own metrics, like alerts_firing, belong to no run). Used to check templates at
# load time and to build `and on(...)` matching in the Prometheus export.
METRIC_LABELS: dict[str, tuple[str, ...]] = {
    name: labels_of(name) or () for name, spec in METRICS.items() if spec.owner == "hooks" or spec.group == "run"
}
# Every label a series of a run may carry (the table's labels are bounded ones).
KNOWN_LABELS: frozenset[str] = frozenset(SERIES_LABELS).union(*METRIC_LABELS.values())
# Event kinds whose count is also exported as a counter (for the Prometheus export).
EVENT_COUNTERS: dict[str, str] = {"optimizer_state_reset": "optimizer_state_resets_total"}

_NAME = r"^[a-z_][a-z0-9_]*$"
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)(ms|s|m|h|d|w))+$")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


class FieldError(ConfigurationError):
    """A model-level check that belongs to one field (the loader names that field)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# ---------------------------------------------------------------------- durations


def parse_duration(value: Any) -> float:
    """Seconds from ``90``, ``"30s"``, ``"5m"``, ``"1h30m"`` (Prometheus units)."""
    if isinstance(value, bool):
        raise ValueError("a duration is a number of seconds or a string like '5m'")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            if not _DURATION.match(text):
                raise ValueError(
                    f"invalid duration {value!r}: use seconds or a string like '30s', '5m', '1h30m'"
                ) from None
            seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(text))
    else:
        raise ValueError("a duration is a number of seconds or a string like '5m'")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"duration must be finite and not negative, got {value!r}")
    return seconds


Duration = Annotated[float, BeforeValidator(parse_duration)]


# ----------------------------------------------------------------------- matchers


class Matcher(BaseModel):
    """One label matcher: ``image`` (equal), ``!=text``, ``=~im.*``, ``!~te.*``.

    Regular expressions are anchored, as in PromQL. A series without the label
    matches as if its value were the empty string.
    """

    model_config = ConfigDict(frozen=True)

    name: str
    op: Literal["=", "!=", "=~", "!~"]
    value: str

    @classmethod
    def parse(cls, name: str, spec: Any) -> Matcher:
        """Build a matcher from a YAML ``labels:`` entry."""
        if isinstance(spec, bool) or not isinstance(spec, str | int | float):
            raise ValueError(f"label {name!r}: give a string such as 'image', '!=text' or '=~im.*'")
        text = str(spec)
        for op in ("!=", "=~", "!~"):
            if text.startswith(op):
                return cls(name=name, op=op, value=text[len(op) :])
        return cls(name=name, op="=", value=text)

    def compile(self) -> Callable[[str | None], bool]:
        """A predicate on a label value (None: label absent)."""
        if self.op in ("=~", "!~"):
            pattern = re.compile(rf"(?:{self.value})\Z")
            if self.op == "=~":
                return lambda v: pattern.match(v or "") is not None
            return lambda v: pattern.match(v or "") is None
        want = self.value
        if self.op == "=":
            return lambda v: (v or "") == want
        return lambda v: (v or "") != want

    def promql(self) -> str:
        """This matcher in PromQL selector syntax."""
        escaped = self.value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'{self.name}{self.op}"{escaped}"'


def _matchers(value: Any) -> tuple[Matcher, ...]:
    if value is None:
        return ()
    if isinstance(value, tuple) and all(isinstance(m, Matcher) for m in value):
        return value
    if not isinstance(value, Mapping):
        raise ValueError("labels must be a mapping of label name to value, e.g. {modality: image}")
    out = []
    for name, spec in value.items():
        if not isinstance(name, str) or not _LABEL_NAME.match(name):
            raise ValueError(f"label name {name!r} is not a valid Prometheus label name")
        matcher = Matcher.parse(name, spec)
        if matcher.op in ("=~", "!~"):
            try:
                re.compile(matcher.value)
            except re.error as exc:
                raise ValueError(f"label {name!r}: invalid regular expression: {exc}") from None
        out.append(matcher)
    return tuple(out)


Matchers = Annotated[tuple[Matcher, ...], BeforeValidator(_matchers)]


def _metric_name(value: str) -> str:
    if isinstance(value, str) and value.startswith(PREFIX):
        raise ValueError(f"use the wire name without the {PREFIX!r} prefix: {value[len(PREFIX) :]!r}")
    return value


def _known_metric(value: str) -> str:
    # A rule on a name no report carries would never fire: refuse it at load time.
    if value not in METRIC_LABELS:
        close = difflib.get_close_matches(value, list(METRIC_LABELS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown metric {value!r}: no report carries it, so the rule would "
            f"never fire{hint} (metrics: docs/metrics.md)"
        )
    return value


MetricName = Annotated[
    str,
    BeforeValidator(_metric_name),
    Field(min_length=1, max_length=128, pattern=_NAME),
    AfterValidator(_known_metric),
]


# -------------------------------------------------------------------------- rules


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Condition(_Model):
    """A further condition of a threshold rule, on another metric of the same series.

    Its series is the one whose labels equal the primary series' labels restricted
    to the labels that metric has (same run and rank).
    """

    metric: MetricName
    labels: Matchers = ()
    above: float | None = None
    below: float | None = None

    @model_validator(mode="after")
    def _one_threshold(self) -> Condition:
        if (self.above is None) == (self.below is None):
            raise ValueError("give exactly one of 'above' or 'below'")
        return self

    def holds(self, value: float) -> bool | None:
        """True/False, or None when the value is NaN (no evidence)."""
        if value != value:
            return None
        if self.above is not None:
            return value > self.above
        assert self.below is not None  # the validator requires exactly one of above/below
        return value < self.below


class _RuleBase(_Model):
    alert: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
    severity: Severity = "warning"
    summary: Annotated[str, Field(min_length=1, max_length=1024)]
    description: Annotated[str, Field(max_length=4096)] = ""
    runbook: str = ""

    @property
    def kind(self) -> str:
        raise NotImplementedError

    def template_fields(self) -> frozenset[str]:
        """Names a summary/description template may use."""
        return RULE_FIELDS | set(SERIES_LABELS)

    @model_validator(mode="after")
    def _templates(self) -> _RuleBase:
        allowed = self.template_fields()
        for field_name in ("summary", "description"):
            try:
                check_template(getattr(self, field_name), allowed)
            except ValueError as exc:
                raise FieldError(field_name, str(exc)) from None
        return self


class ThresholdRule(_RuleBase):
    """Fires when a series' value (optionally transformed) stays past a threshold."""

    metric: MetricName
    labels: Matchers = ()
    above: float | None = None
    below: float | None = None
    clear: float | None = None
    transform: Literal["value", "increase", "ratio_to_median"] = "value"
    window: Annotated[int, Field(ge=2, le=10_000)] = 20
    min_history: Annotated[int, Field(ge=1, le=10_000)] | None = None
    """ratio_to_median: reports of history needed before a verdict (default: ``window``)."""
    and_: Annotated[tuple[Condition, ...], Field(alias="and")] = ()
    for_steps: Annotated[int, Field(ge=0)] = 0
    for_: Annotated[Duration, Field(alias="for")] = 0.0
    hold_steps: Annotated[int, Field(ge=0)] = 0
    hold: Duration = 0.0

    @property
    def kind(self) -> str:
        return "threshold"

    @property
    def threshold(self) -> float:
        if self.above is not None:
            return self.above
        assert self.below is not None  # the validator requires exactly one of above/below
        return self.below

    @property
    def history_needed(self) -> int:
        """ratio_to_median: reports of history before the first verdict."""
        return self.min_history if self.min_history is not None else self.window

    @property
    def clear_at(self) -> float:
        """The value the series must get back to (inclusive) before the alert resolves."""
        return self.clear if self.clear is not None else self.threshold

    def template_fields(self) -> frozenset[str]:
        labels = set(METRIC_LABELS.get(self.metric, KNOWN_LABELS))
        labels |= {m.name for m in self.labels}
        return RULE_FIELDS | labels | set(SERIES_LABELS)

    @field_validator("and_", mode="before")
    @classmethod
    def _and_list(cls, value: Any) -> Any:
        if value is None:
            return ()
        if isinstance(value, Mapping):
            raise ValueError("'and' is a list of conditions, e.g. [{metric: ..., above: ...}]")
        return value

    @model_validator(mode="after")
    def _satisfiable(self) -> ThresholdRule:
        # A matcher or a join no series can satisfy would make a rule that never fires.
        _check_matchers(self.metric, self.labels, "labels")
        for i, cond in enumerate(self.and_):
            _check_matchers(cond.metric, cond.labels, f"and[{i}].labels")
            mine, theirs = series_label_sets(self.metric), series_label_sets(cond.metric)
            if not any(set(k) <= set(p) for k in theirs for p in mine):
                raise FieldError(
                    f"and[{i}]",
                    f"no series of {cond.metric} (labels: {_shown(cond.metric)}) can join a series of "
                    f"{self.metric} (labels: {_shown(self.metric)}): a condition reads the series whose "
                    f"labels equal the rule's series' labels, so the rule would never fire",
                )
        return self

    @model_validator(mode="after")
    def _thresholds(self) -> ThresholdRule:
        if (self.above is None) == (self.below is None):
            raise ValueError("give exactly one of 'above' or 'below'")
        for name in ("window", "min_history"):
            if name in self.model_fields_set and self.transform != "ratio_to_median":
                raise FieldError(name, f"'{name}' applies only to 'transform: ratio_to_median'")
        if self.min_history is not None and self.min_history > self.window:
            raise FieldError("min_history", f"min_history ({self.min_history}) must not exceed window ({self.window})")
        if self.clear is not None:
            if self.above is not None and self.clear > self.above:
                raise FieldError("clear", f"clear ({self.clear:g}) must not be above 'above' ({self.above:g})")
            if self.below is not None and self.clear < self.below:
                raise FieldError("clear", f"clear ({self.clear:g}) must not be below 'below' ({self.below:g})")
        return self


class EventRule(_RuleBase):
    """Fires on the report carrying the event; resolves after a hold without one."""

    event: Annotated[str, Field(min_length=1, max_length=64, pattern=_NAME)]
    labels: Matchers = ()
    hold_steps: Annotated[int, Field(ge=0)] = 0
    hold: Duration = 0.0
    # A counter of the same events, for the Prometheus export.
    counter: MetricName | None = None

    @property
    def kind(self) -> str:
        return "event"

    @property
    def counter_metric(self) -> str | None:
        return self.counter or EVENT_COUNTERS.get(self.event)

    def template_fields(self) -> frozenset[str]:
        return RULE_FIELDS | KNOWN_LABELS | {m.name for m in self.labels} | {"detail"}


def series_label_sets(metric: str) -> list[tuple[str, ...]]:
    """The label names one series of ``metric`` carries besides run/rank: one set, except
    for the ``adam_*`` metrics, whose series carry ``param`` (a parameter's own) or
    ``group`` (the rest of its param group), never both."""
    labels = METRIC_LABELS.get(metric, ())
    if metric.startswith("adam_") and set(labels) == {"param", "group"}:
        return [("param",), ("group",)]
    return [labels]


def _shown(metric: str) -> str:
    sets = [", ".join(k) or "none" for k in series_label_sets(metric)]
    return " or ".join(sets) + " besides " + ", ".join(SERIES_LABELS)


def _check_matchers(metric: str, matchers: tuple[Matcher, ...], where: str) -> None:
    carried = set(SERIES_LABELS).union(*series_label_sets(metric))
    for m in matchers:
        # A series without the label matches as if its value were "": only a matcher that
        # accepts "" can ever match on a label the metric does not carry.
        if m.name not in carried and not m.compile()(None):
            raise FieldError(
                where,
                f"{metric} has no label {m.name!r} (its labels: {_shown(metric)}), so "
                f"{m.name}{m.op}{m.value!r} matches no series and the rule would never fire",
            )


class SilenceRule(_RuleBase):
    """Fires when a run has not reported for ``silent_for`` (checked by the timer)."""

    silent_for: Annotated[Duration, Field(gt=0)]

    @property
    def kind(self) -> str:
        return "silence"


Rule = ThresholdRule | EventRule | SilenceRule
RULE_TYPES = (ThresholdRule, EventRule, SilenceRule)
"""The rule classes, for ``isinstance`` checks."""
KINDS: dict[str, type[ThresholdRule] | type[EventRule] | type[SilenceRule]] = {
    "metric": ThresholdRule,
    "event": EventRule,
    "silent_for": SilenceRule,
}
"""The key that tells a rule's kind -> its class."""
