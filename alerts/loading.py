"""Rule files: YAML in, validated rules out, with errors that say where.

A rule file is a YAML list of rules (or a mapping with a ``rules:`` list),
loaded with ``yaml.safe_load``; the rule format is in ``docs/rules.md`` and the
model in :mod:`trainvitals.alerts.model`. ``"default"`` stands for the files
shipped in ``trainvitals/alerts/rules/``; a folder for its ``*.yaml``/``*.yml``
files. Alert names must be unique across everything loaded together. Every
error names the file, the rule and the field::

    rules/x.yaml: rule 'GradientDilution' (#1): field 'above': Input should be a valid number
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from trainvitals.alerts.model import KINDS, FieldError, Rule

__all__ = [
    "RuleError",
    "default_rule_paths",
    "load_rule_file",
    "load_rules",
    "parse_rules",
]


class RuleError(ValueError):
    """A rule file that cannot be used; the message names the file, rule and field."""

    def __init__(self, message: str, *, source: str = "", rule: str | None = None,
                 index: int | None = None, field: str | None = None) -> None:
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
        raise _rule_error(source, None, index, None,
                          "a rule is a mapping with 'alert' and 'metric', 'event' or 'silent_for'")
    kinds = [key for key in KINDS if key in raw]
    if len(kinds) != 1:
        found = f" (found {', '.join(kinds)})" if kinds else ""
        raise _rule_error(source, name, index, None,
                          f"give exactly one of 'metric', 'event' or 'silent_for'{found}")
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
                msg = msg[len("Value error, "):]
        # pydantic names aliased fields by alias already ('and', 'for').
        if err["type"] == "extra_forbidden":
            msg = f"unknown field (known: {', '.join(sorted(_aliases(model)))})"
        field = _loc(loc) or None
        extra = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
        raise _rule_error(source, name, index, field, msg + extra) from None


def _check_unique(rules: Sequence[Rule], sources: Sequence[str], indices: Sequence[int]) -> None:
    seen: dict[str, tuple[str, int]] = {}
    for rule, source, index in zip(rules, sources, indices, strict=True):
        if rule.alert in seen:
            other = seen[rule.alert]
            raise _rule_error(source, rule.alert, index, "alert",
                              f"duplicate alert name (also {other[0]} #{other[1]})")
        seen[rule.alert] = (source, index)


def parse_rules(data: Any, source: str = "<rules>") -> list[Rule]:
    """Validate already-loaded YAML data (a list of rules or ``{rules: [...]}``)."""
    if isinstance(data, Mapping) and set(data) == {"rules"}:
        data = data["rules"]
    if data is None:
        return []
    if not isinstance(data, list):
        raise RuleError(f"{source}: a rule file is a YAML list of rules (or a mapping with 'rules:')",
                        source=source)
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
