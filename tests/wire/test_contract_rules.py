"""Each contract rule is defined once, in wire/: the source tree is read for copies.

The rules: the body format's version and header, reading a line of recorded reports,
the run end, the bearer check, and the drift figure as sent (the collector adds a
lifetime series, it does not rewrite the job's). Run names have their own copy
detector (tests/wire/test_runs.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_PACKAGES = ("hooks", "monitor", "alerts", "wire", "demo", "audit", "errors")

# rule -> (its one home, the patterns that spell it)
_RULES: dict[str, tuple[str, tuple[re.Pattern[str], ...]]] = {
    "the body format's version": (
        "wire/schema.py",
        (
            re.compile(r"Literal\[\s*1\s*\]"),
            re.compile(r"SCHEMA_VERSION\s*(:\s*int\s*)?=(?!=)"),
            re.compile(r"unsupported schema version"),
        ),
    ),
    "the body's header": (
        "wire/body.py",
        (re.compile(r"""b['"]\{\\?"schema"""), re.compile(r"""['"]\{"schema":\s*\d""")),
    ),
    "which line of recorded reports is a body": (
        "wire/report_files.py",
        (re.compile(r"""\\?"reports\\?"['"]?\s+(not\s+)?in\b"""),),
    ),
    "the run end": (
        "wire/schema.py",
        (
            re.compile(r"""\.kind\s*==\s*(RUN_END_EVENT|["']run_end["'])"""),
            re.compile(r"""RUN_END_EVENT\s*=(?!=)"""),
        ),
    ),
    "the bearer check": (
        "wire/bearer.py",
        (
            re.compile(r"compare_digest\("),
            re.compile(r"""\.lower\(\)\s*[!=]=\s*b?["']bearer["']"""),
            re.compile(r"""Bearer realm="""),
        ),
    ),
}

# The collector never changes a value it was sent: no assignment to a sample's value.
_REWRITE = re.compile(r"\b(s|sample|samples\[\w+\])\.value\s*=(?!=)")


def _copies(rules: dict[str, tuple[str, tuple[re.Pattern[str], ...]]], files: dict[str, str]) -> list[str]:
    found = []
    for what, (home, patterns) in rules.items():
        for rel, text in files.items():
            if rel == home:
                continue
            for pattern in patterns:
                for m in pattern.finditer(text):
                    line = text.count("\n", 0, m.start()) + 1
                    found.append(f"{rel}:{line}: {what} (defined in {home}): {m.group(0)!r}")
    return found


def _tree() -> dict[str, str]:
    return {
        str(path.relative_to(ROOT)): path.read_text(encoding="utf-8")
        for package in _PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def test_each_contract_rule_is_defined_once_in_wire():
    tree = _tree()
    for home, _ in _RULES.values():
        assert home in tree, home
    found = _copies(_RULES, tree)
    assert not found, "\n".join(found)


def test_the_collector_does_not_rewrite_what_it_was_sent():
    found = [
        f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
        for rel, text in _tree().items()
        if rel.startswith("monitor/")
        for m in _REWRITE.finditer(text)
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("what", "old"),
    [  # the forms the tree had before each rule had one home: each is caught
        ("the body format's version", "    schema_version: Literal[1]"),
        ("the body format's version", 'f"schema: unsupported schema version {got!r}; this collector supports"'),
        ("the body's header", """        stripped = b'{"schema":1,"reports":[' + stripped + b"]}\""""),
        ("which line of recorded reports is a body", '                if isinstance(obj, dict) and "reports" in obj:'),
        ("which line of recorded reports is a body", """    if stripped.startswith(b"{") and b'"reports"' not in x:"""),
        ("the run end", "            self._last_ended = any(ev.kind == RUN_END_EVENT for ev in validated.events)"),
        ("the bearer check", '    if scheme.lower() != "bearer" or not secrets.compare_digest(given, token):'),
        ("the bearer check", "_REALM = 'Bearer realm=\"trainvitals\"'"),
    ],
)
def test_the_copy_detector_finds_the_old_copies(what, old):
    assert _copies({what: _RULES[what]}, {"monitor/old.py": old}), old


def test_the_rewrite_detector_finds_the_old_rewrite():
    assert _REWRITE.search("                            s.value = bound")
