"""Rule files: YAML in, validated rules out, with errors that say where.

:func:`resolve_rules` turns every accepted way of naming rules (``"default"``,
files, folders, rule objects, a mix of them) into one list of rules; every
caller uses it. A rule file is a YAML list of rules (or a mapping with a
``rules:`` list), loaded with ``yaml.safe_load``; the rule format is in
``docs/rules.md`` and the model in :mod:`trainvitals.alerts.model`.
``"default"`` stands for the files shipped in ``trainvitals/alerts/rules/``; a
folder for its ``*.yaml``/``*.yml`` files. Alert names must be unique across
everything resolved together. Every error names the file, the rule and the
field::

    rules/x.yaml: rule 'GradientDilution' (#1): field 'above': Input should be a valid number
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from trainvitals.alerts.model import KINDS, RULE_TYPES, FieldError, Rule, ThresholdRule
from trainvitals.wire.errors import ConfigurationError

__all__ = [
    "RuleError",
    "RuleSpec",
    "default_rule_paths",
    "load_rule_file",
    "load_rules",
    "parse_rules",
    "resolve_rules",
]


class RuleError(ConfigurationError):
    """A rule file that cannot be used; the message names the file, rule and field."""

    def __init__(
        self,
        message: str,
        *,
        source: str = "",
        rule: str | None = None,
        index: int | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.source = source
        self.rule = rule
        self.index = index
        self.field = field


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


def _aliases(model: type[BaseModel]) -> list[str]:
    return [f.alias or n for n, f in model.model_fields.items()]


def _parse_one(raw: Any, source: str, index: int) -> Rule:
    name = raw.get("alert") if isinstance(raw, Mapping) else None
    name = name if isinstance(name, str) else None
    if not isinstance(raw, Mapping):
        raise _rule_error(
            source, None, index, None, "a rule is a mapping with 'alert' and 'metric', 'event' or 'silent_for'"
        )
    kinds = [key for key in KINDS if key in raw]
    if len(kinds) != 1:
        found = f" (found {', '.join(kinds)})" if kinds else ""
        raise _rule_error(source, name, index, None, f"give exactly one of 'metric', 'event' or 'silent_for'{found}")
    model = KINDS[kinds[0]]
    try:
        return model.model_validate(dict(raw))
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = list(err["loc"])
        ctx_error = (err.get("ctx") or {}).get("error")
        if isinstance(ctx_error, FieldError):
            loc = [*loc, ctx_error.field]
            msg = str(ctx_error)
        else:
            msg = err["msg"]
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, ") :]
        # pydantic names aliased fields by alias already ('and', 'for').
        if err["type"] == "extra_forbidden":
            msg = f"unknown field (known: {', '.join(sorted(_aliases(model)))})"
        field = _loc(loc) or None
        extra = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
        raise _rule_error(source, name, index, field, msg + extra) from None


def _check_unique(rules: Sequence[Rule], sources: Sequence[str], indices: Sequence[int]) -> None:
    # One alert may be split into variants by severity (as in Prometheus: the same alertname
    # with severity page and warning), each a threshold rule on the same metric: their
    # conditions say which applies (LossNotAccumNormalized per optimizer family).
    seen: dict[str, list[tuple[Rule, str, int]]] = {}
    for rule, source, index in zip(rules, sources, indices, strict=True):
        for other, other_source, other_index in seen.get(rule.alert, []):
            variant = (
                isinstance(rule, ThresholdRule)
                and isinstance(other, ThresholdRule)
                and rule.metric == other.metric
                and rule.severity != other.severity
            )
            if not variant:
                raise _rule_error(
                    source,
                    rule.alert,
                    index,
                    "alert",
                    f"duplicate alert name (also {other_source} #{other_index}); two rules may share a name "
                    "only as variants of one threshold alert: the same metric, different severities",
                )
        seen.setdefault(rule.alert, []).append((rule, source, index))


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


RuleSpec = str | Path | Rule | Iterable[str | Path | Rule] | None
"""What names rules: ``"default"``, a file, a folder, a rule object, or an iterable of
those; ``None`` for no rules."""

_OBJECTS = "<rule objects>"  # the source named in errors about rules given as objects


def resolve_rules(spec: RuleSpec = "default") -> list[Rule]:
    """The rules ``spec`` names, validated, in the order given.

    - ``"default"``: the files shipped in ``trainvitals/alerts/rules/``;
    - a path (str or :class:`~pathlib.Path`): a rule file, or a folder (its
      ``*.yaml``/``*.yml`` files in name order);
    - a rule object (:class:`~trainvitals.alerts.model.ThresholdRule`,
      :class:`~trainvitals.alerts.model.EventRule`,
      :class:`~trainvitals.alerts.model.SilenceRule`): itself;
    - an iterable of any of these; ``None`` or an empty iterable: no rules.

    Every caller (the collector's service, the in-process evaluator, the CLI)
    goes through here. Raises :class:`RuleError` naming the file, rule and field,
    also for an alert name used twice anywhere in ``spec``.
    """
    if spec is None:
        return []
    if isinstance(spec, str | Path) or isinstance(spec, RULE_TYPES):
        spec = [spec]
    elif isinstance(spec, Mapping) or not isinstance(spec, Iterable):
        raise _spec_error(spec)
    rules: list[Rule] = []
    sources: list[str] = []
    indices: list[int] = []
    for position, item in enumerate(spec, start=1):
        if isinstance(item, RULE_TYPES):
            rules.append(item)
            sources.append(_OBJECTS)
            indices.append(position)
            continue
        if not isinstance(item, str | Path):
            raise _spec_error(item, position)
        for path in _rule_files(item):
            loaded = load_rule_file(path)
            rules.extend(loaded)
            sources.extend([str(path)] * len(loaded))
            indices.extend(range(1, len(loaded) + 1))
    _check_unique(rules, sources, indices)
    return rules


load_rules = resolve_rules
"""The same function, under the name the package has always exported."""


def _rule_files(item: str | Path) -> list[Path]:
    if str(item) == "default":
        return default_rule_paths()
    path = Path(item)
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml"))
    return [path]


def _spec_error(item: Any, position: int | None = None) -> RuleError:
    where = f"rules: item #{position}" if position is not None else "rules"
    return RuleError(
        f"{where}: {type(item).__name__} {item!r:.60} names no rules; give 'default', "
        "a rule file or folder, rule objects, or a list of these",
        source="rules",
    )
