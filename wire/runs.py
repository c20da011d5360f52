"""Run names: the one rule, and the one check every side uses.

A run name is 1-128 characters: parts of letters, digits and ``_ . : -`` joined by
``/``, none of them empty, ``.`` or ``..``, so that a URL path carries the name as it
is (the live-settings routes ``/v1/runs/{run}/settings`` address a run by its name).

:func:`check_run` is the check: ``attach()``, ``trainvitals run``, the settings
routes and both decoders of a report (the pydantic models and the collector's msgspec
structs) use it or the patterns below, which say the same thing. The whole name must
match (``fullmatch``): ``"r1\\n"`` is refused, where ``re.match`` with ``$`` would let
the final newline through.
"""

from __future__ import annotations

import re
from typing import Any

from trainvitals.wire.errors import ConfigurationError

__all__ = [
    "MAX_RUN",
    "RUN_CHARS",
    "RUN_PATTERN",
    "RUN_REGEX",
    "RUN_RULE",
    "SENDER_PATTERN",
    "SENDER_REGEX",
    "check_run",
    "is_run",
]

MAX_RUN = 128
"""The longest run name (characters)."""

RUN_CHARS = r"A-Za-z0-9_.:\-"
"""The characters of a run name's parts, as the inside of a regex character class."""
_FIRST = r"A-Za-z0-9_:\-"  # a part's first character: not a dot (dots are the next two forms)
_RUN_PART = rf"(?:[{_FIRST}][{RUN_CHARS}]*|\.[{_FIRST}][{RUN_CHARS}]*|\.\.[{RUN_CHARS}]+)"
_RUN_BODY = rf"{_RUN_PART}(?:/{_RUN_PART})*"
RUN_PATTERN = rf"^{_RUN_BODY}$"
"""The run-name pattern as JSON Schema and pydantic read it (``$``: the end of the text
in ECMA and Rust regexes; not in Python's, use :data:`RUN_REGEX` there)."""
RUN_REGEX = rf"\A{_RUN_BODY}\Z"
"""The same pattern for Python's ``re`` (``re.search`` as msgspec runs it, or ``match``)."""
RUN_RULE = "use 1-128 characters from letters, digits and _ . : - /, without empty, '.' or '..' parts between slashes"
"""What the pattern asks for, in words (error messages say it)."""

_SENDER_BODY = r"[A-Za-z0-9_\-]{1,64}"
SENDER_PATTERN = rf"^{_SENDER_BODY}$"
"""A report's ``sender`` (one per ``Monitor``), for JSON Schema and pydantic."""
SENDER_REGEX = rf"\A{_SENDER_BODY}\Z"
"""The same for Python's ``re``."""

_RUN = re.compile(_RUN_BODY)


def is_run(run: Any) -> bool:
    """Whether ``run`` is a valid run name (a str of 1-128 characters that fits the rule)."""
    return isinstance(run, str) and 0 < len(run) <= MAX_RUN and _RUN.fullmatch(run) is not None


def check_run(run: Any, name: str = "run") -> str:
    """``run`` if it is a valid run name; else :class:`~trainvitals.errors.ConfigurationError`
    (a ValueError) ``{name}={run!r}: {RUN_RULE}``.

    ``name`` is what the caller calls it (``run``, ``TRAINVITALS_RUN``, ``--run``), so the
    message points at the argument to fix."""
    if not is_run(run):
        raise ConfigurationError(f"{name}={run!r}: {RUN_RULE}")
    return str(run)
