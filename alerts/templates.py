"""Summary/description templates: checked when a rule loads, rendered when an alert changes.

Templates are Python ``str.format`` strings over one namespace: the series'
labels plus the fields in :data:`RULE_FIELDS` (``{value:.1f}``, ``{run}``,
``{modality}``). At load time an unknown field (``{modalty}``) or a format the
field cannot take (``{run:.1f}``: labels are strings) is an error; at render time
nothing raises and a label the series lacks shows as ``?``. The rule format is in
``docs/rules.md``; the PromQL translation of templates is in
:mod:`trainvitals.alerts.export`.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from typing import Any

__all__ = ["NUMERIC_FIELDS", "RULE_FIELDS", "check_template", "render_template"]

# Fields every rule offers besides the series labels.
RULE_FIELDS = frozenset({"alertname", "severity", "value", "step", "above", "below", "clear"})
# Those that render as numbers (the rest, like every label, are strings).
NUMERIC_FIELDS = ("value", "step", "above", "below", "clear")


def check_template(text: str, allowed: frozenset[str]) -> None:
    """Raise ValueError unless ``text`` renders with the fields ``allowed`` (named fields only)."""
    try:
        parts = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise ValueError(f"invalid template: {exc}") from None
    # Labels render as strings, the rule's numbers as numbers: "{run:.1f}" fails here.
    sample: dict[str, Any] = {name: "x" for name in allowed}
    sample.update({k: 0.0 for k in NUMERIC_FIELDS if k in allowed})
    for _, name, _spec, _conv in parts:
        if name is None:
            continue
        root = re.split(r"[.\[]", name, maxsplit=1)[0]
        if root == "" or root.isdigit():
            raise ValueError("templates take named fields only, e.g. {value:.1f} or {run}")
        if root not in allowed:
            raise ValueError(f"unknown template field {{{root}}}; this rule offers: {', '.join(sorted(allowed))}")
        if root != name:
            raise ValueError(f"template field {{{name}}}: attribute and index access are not allowed")
    try:
        string.Formatter().vformat(text, (), sample)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"template does not render: {exc}") from None


class _Missing(dict[str, Any]):
    def __missing__(self, key: str) -> str:
        return "?"


def render_template(text: str, fields: Mapping[str, Any]) -> str:
    """Render a summary/description; never raises (a missing field renders as '?')."""
    try:
        return string.Formatter().vformat(text, (), _Missing(fields))
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        # A numeric format applied to a missing field ("?"): fall back to plain fields.
        safe = re.sub(r"\{([A-Za-z_][A-Za-z0-9_]*)(?:![rsa])?(?::[^{}]*)?\}", r"{\1}", text)
        try:
            return string.Formatter().vformat(safe, (), _Missing(fields))
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return text
