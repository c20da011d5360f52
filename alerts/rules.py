"""The rule model: YAML rule files, validated with pydantic.

A rule file is a YAML list of rules (or a mapping with a ``rules:`` list),
loaded with ``yaml.safe_load``. Three kinds, told apart by the key that names
what they watch::

    - alert: GradientDilution              # unique name (the `alertname` label)
      metric: modality_dilution_ratio      # wire name, without the trainvitals_ prefix
      labels: {modality: "!=text"}         # matchers: value (equal), "!=v", "=~regex", "!~regex"
      above: 5                             # or `below:`; fires past it (strictly)
      clear: 3                             # hysteresis: resolves only back at/below this
      transform: value                     # or `increase` (counters: the increase since the
                                           # series' previous report) or `ratio_to_median`
                                           # (value / median of its previous `window` reports)
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

Templates are checked when the file loads: an unknown field (``{modalty}``) or
a format the field cannot take (``{run:.1f}``) is an error; a label missing
from a series at render time shows as ``?``. Every error names the file, the
rule and the field::

    rules/x.yaml: rule 'GradientDilution' (#1): field 'above': Input should be a valid number
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from trainvitals.wire import METRICS, PREFIX

__all__ = [
    "KNOWN_LABELS",
    "METRIC_LABELS",
    "Condition",
    "EventRule",
    "Matcher",
    "Rule",
    "RuleError",
    "SilenceRule",
    "ThresholdRule",
    "default_rule_paths",
    "load_rule_file",
    "load_rules",
    "parse_duration",
    "parse_rules",
]

Severity = Literal["critical", "page", "error", "warning", "ticket", "info"]

# Labels each known metric carries besides `run` (and `rank` on non-zero ranks),
# from the wire's metric catalogue. Used to check templates at load time and to
# build `and on(...)` matching in the Prometheus export.
METRIC_LABELS: dict[str, tuple[str, ...]] = {
    name: spec.labels for name, spec in METRICS.items() if spec.owner == "hooks" or spec.group == "run"
}
# Every label a sample may carry by DESIGN (bounded labels only).
KNOWN_LABELS = frozenset(
    {"run", "rank", "modality", "param", "group", "task", "role", "threshold", "what", "scope", "other"}
)
# Event kinds whose count is also exported as a counter (for the Prometheus export).
EVENT_COUNTERS: dict[str, str] = {"optimizer_state_reset": "optimizer_state_resets_total"}

# Template fields every rule offers besides the series labels.
TEMPLATE_FIELDS = frozenset({"alertname", "severity", "value", "step", "above", "below", "clear"})
_NUMERIC_FIELDS = ("value", "step", "above", "below", "clear")

_NAME = r"^[a-z_][a-z0-9_]*$"
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)(ms|s|m|h|d|w))+$")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


class RuleError(ValueError):
    """A rule file that cannot be used; the message names the file, rule and field."""

    def __init__(self, message: str, *, source: str = "", rule: str | None = None,
                 index: int | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.source = source
        self.rule = rule
        self.index = index
        self.field = field


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
                return cls(name=name, op=op, value=text[len(op):])
        return cls(name=name, op="=", value=text)

    def compile(self):
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
        raise ValueError(f"use the wire name without the {PREFIX!r} prefix: {value[len(PREFIX):]!r}")
    return value


MetricName = Annotated[
    str, BeforeValidator(_metric_name), Field(min_length=1, max_length=128, pattern=_NAME)
]


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
        return value > self.above if self.above is not None else value < self.below  # type: ignore[operator]


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
        return TEMPLATE_FIELDS | {"run", "rank"}

    @model_validator(mode="after")
    def _templates(self):
        allowed = self.template_fields()
        for field_name in ("summary", "description"):
            _check_template(getattr(self, field_name), allowed, field_name)
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
        return self.above if self.above is not None else self.below  # type: ignore[return-value]

    @property
    def clear_at(self) -> float:
        """The value the series must get back to (inclusive) before the alert resolves."""
        return self.clear if self.clear is not None else self.threshold

    def template_fields(self) -> frozenset[str]:
        labels = set(METRIC_LABELS.get(self.metric, KNOWN_LABELS))
        labels |= {m.name for m in self.labels}
        return TEMPLATE_FIELDS | labels | {"run", "rank"}

    @field_validator("and_", mode="before")
    @classmethod
    def _and_list(cls, value: Any) -> Any:
        if value is None:
            return ()
        if isinstance(value, Mapping):
            raise ValueError("'and' is a list of conditions, e.g. [{metric: ..., above: ...}]")
        return value

    @model_validator(mode="after")
    def _thresholds(self) -> ThresholdRule:
        if (self.above is None) == (self.below is None):
            raise ValueError("give exactly one of 'above' or 'below'")
        if "window" in self.model_fields_set and self.transform != "ratio_to_median":
            raise _FieldError("window", "'window' applies only to 'transform: ratio_to_median'")
        if self.clear is not None:
            if self.above is not None and self.clear > self.above:
                raise _FieldError("clear", f"clear ({self.clear:g}) must not be above 'above' ({self.above:g})")
            if self.below is not None and self.clear < self.below:
                raise _FieldError("clear", f"clear ({self.clear:g}) must not be below 'below' ({self.below:g})")
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
        return TEMPLATE_FIELDS | KNOWN_LABELS | {m.name for m in self.labels} | {"detail"}


class SilenceRule(_RuleBase):
    """Fires when a run has not reported for ``silent_for`` (checked by the timer)."""

    silent_for: Annotated[Duration, Field(gt=0)]

    @property
    def kind(self) -> str:
        return "silence"


Rule = Union[ThresholdRule, EventRule, SilenceRule]
_KINDS: dict[str, type[_RuleBase]] = {
    "metric": ThresholdRule,
    "event": EventRule,
    "silent_for": SilenceRule,
}


class _FieldError(ValueError):
    """A model-level check that belongs to one field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _check_template(text: str, allowed: frozenset[str], field_name: str) -> None:
    try:
        parts = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise _FieldError(field_name, f"invalid template: {exc}") from None
    # Labels render as strings, the rule's numbers as numbers: "{run:.1f}" fails here.
    sample: dict[str, Any] = {name: "x" for name in allowed}
    sample.update({k: 0.0 for k in _NUMERIC_FIELDS if k in allowed})
    for _, name, _spec, _conv in parts:
        if name is None:
            continue
        root = re.split(r"[.\[]", name, maxsplit=1)[0]
        if root == "" or root.isdigit():
            raise _FieldError(field_name, "templates take named fields only, e.g. {value:.1f} or {run}")
        if root not in allowed:
            raise _FieldError(
                field_name,
                f"unknown template field {{{root}}}; this rule offers: {', '.join(sorted(allowed))}",
            )
        if root != name:
            raise _FieldError(field_name, f"template field {{{name}}}: attribute and index access are not allowed")
    try:
        string.Formatter().vformat(text, (), sample)
    except (ValueError, TypeError, KeyError) as exc:
        raise _FieldError(field_name, f"template does not render: {exc}") from None


def render_template(text: str, fields: Mapping[str, Any]) -> str:
    """Render a summary/description; never raises (a missing field renders as '?')."""

    class _Missing(dict):
        def __missing__(self, key: str) -> str:
            return "?"

    try:
        return string.Formatter().vformat(text, (), _Missing(fields))
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        # A numeric format applied to a missing field ("?"): fall back to plain fields.
        safe = re.sub(r"\{([A-Za-z_][A-Za-z0-9_]*)(?:![rsa])?(?::[^{}]*)?\}", r"{\1}", text)
        try:
            return string.Formatter().vformat(safe, (), _Missing(fields))
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return text


def _loc(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _rule_error(source: str, name: str | None, index: int, field: str | None, msg: str) -> RuleError:
    where = f"{source}: rule {name!r} (#{index})" if name else f"{source}: rule #{index}"
    text = f"{where}: field {field!r}: {msg}" if field else f"{where}: {msg}"
    return RuleError(text, source=source, rule=name, index=index, field=field)


def _parse_one(raw: Any, source: str, index: int) -> Rule:
    name = raw.get("alert") if isinstance(raw, Mapping) else None
    name = name if isinstance(name, str) else None
    if not isinstance(raw, Mapping):
        raise _rule_error(source, None, index, None, "a rule is a mapping with 'alert' and 'metric', 'event' or 'silent_for'")
    kinds = [key for key in _KINDS if key in raw]
    if len(kinds) != 1:
        found = f" (found {', '.join(kinds)})" if kinds else ""
        raise _rule_error(source, name, index, None, f"give exactly one of 'metric', 'event' or 'silent_for'{found}")
    model = _KINDS[kinds[0]]
    try:
        return model.model_validate(dict(raw))  # type: ignore[return-value]
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [p for p in err["loc"]]
        ctx_error = (err.get("ctx") or {}).get("error")
        if isinstance(ctx_error, _FieldError):
            loc = [*loc, ctx_error.field]
            msg = str(ctx_error)
        else:
            msg = err["msg"]
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, "):]
        # pydantic names aliased fields by alias already ('and', 'for').
        if err["type"] == "extra_forbidden":
            msg = f"unknown field (known: {', '.join(sorted(_aliases(model)))})"
        field = _loc(loc) or None
        extra = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
        raise _rule_error(source, name, index, field, msg + extra) from None


def _aliases(model: type[BaseModel]) -> list[str]:
    return [f.alias or n for n, f in model.model_fields.items()]


def parse_rules(data: Any, source: str = "<rules>") -> list[Rule]:
    """Validate already-loaded YAML data (a list of rules or ``{rules: [...]}``)."""
    if isinstance(data, Mapping) and set(data) == {"rules"}:
        data = data["rules"]
    if data is None:
        return []
    if not isinstance(data, list):
        raise RuleError(f"{source}: a rule file is a YAML list of rules (or a mapping with 'rules:')", source=source)
    rules = [_parse_one(raw, source, i) for i, raw in enumerate(data, start=1)]
    _check_unique(rules, [source] * len(rules), list(range(1, len(rules) + 1)))
    return rules


def _check_unique(rules: Sequence[Rule], sources: Sequence[str], indices: Sequence[int]) -> None:
    seen: dict[str, tuple[str, int]] = {}
    for rule, source, index in zip(rules, sources, indices, strict=True):
        if rule.alert in seen:
            other = seen[rule.alert]
            raise _rule_error(source, rule.alert, index, "alert",
                              f"duplicate alert name (also {other[0]} #{other[1]})")
        seen[rule.alert] = (source, index)


def load_rule_file(path: str | Path) -> list[Rule]:
    """Load and validate one YAML rule file."""
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RuleError(f"{source}: cannot read: {exc.strerror or exc}", source=source) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise RuleError(f"{source}:{where}: invalid YAML: {problem}", source=source) from None
    return parse_rules(data, source)


def default_rule_paths() -> list[Path]:
    """The rule files shipped in ``trainvitals/alerts/rules/``."""
    folder = resources.files("trainvitals.alerts").joinpath("rules")
    return sorted(Path(str(p)) for p in folder.iterdir() if p.name.endswith((".yaml", ".yml")))


def load_rules(sources: str | Path | Iterable[str | Path] | None = "default") -> list[Rule]:
    """Load rules from ``"default"`` (the shipped files), files and folders.

    ``None`` or an empty list gives no rules. Alert names must be unique across
    all the files loaded together.
    """
    if sources is None:
        return []
    if isinstance(sources, str | Path):
        sources = [sources]
    paths: list[Path] = []
    for src in sources:
        if str(src) == "default":
            paths.extend(default_rule_paths())
            continue
        p = Path(src)
        if p.is_dir():
            paths.extend(sorted(q for q in p.iterdir() if q.suffix in (".yaml", ".yml")))
        else:
            paths.append(p)
    rules: list[Rule] = []
    origin: list[str] = []
    indices: list[int] = []
    for p in paths:
        loaded = load_rule_file(p)
        rules.extend(loaded)
        origin.extend([str(p)] * len(loaded))
        indices.extend(range(1, len(loaded) + 1))
    _check_unique(rules, origin, indices)
    return rules
