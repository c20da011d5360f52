"""The repository's own documentation stays complete and current.

- ``docs/metrics.md`` is the metric reference generated from the wire's metric table.
- Every document the code, the rules or the README names exists in the repository,
  and nothing cites the design notes that live outside it.
- Relative links between the docs and the runbooks point to files that exist, and
  their ``#anchors`` to headings that exist (GitHub's heading anchors).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import TEST_TOOLS_INSTALL
from trainvitals.wire.reference import reference_markdown

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("hooks", "monitor", "alerts", "wire")
CODE_SUFFIXES = (".py", ".yaml", ".yml", ".md")
# Not part of the repository's content: VCS data, environments, build outputs.
SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "__pycache__", ".ruff_cache", ".pytest_cache", "node_modules"}

REGENERATE = "python -m trainvitals.wire.reference > docs/metrics.md"


def _walk(top: Path) -> Iterator[Path]:
    for path in sorted(top.iterdir()):
        if path.name in SKIP_DIRS or path.name.endswith(".egg-info"):
            continue
        if path.is_dir():
            yield from _walk(path)
        else:
            yield path


def _code_files() -> list[Path]:
    files = [p for d in CODE_DIRS for p in _walk(ROOT / d) if p.suffix in CODE_SUFFIXES]
    return [*files, ROOT / "README.md"]


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    yield from enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# -- GitHub heading anchors -------------------------------------------------------------
_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")


def _outside_fences(text: str) -> Iterator[tuple[int, str]]:
    """Lines of a markdown text that are not inside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings (repeated headings get -1, -2 ...)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in _outside_fences(path.read_text(encoding="utf-8")):
        m = _HEADING.match(line)
        if not m:
            continue
        base = _slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_anchor_slugs_follow_github():
    assert _slug("I1. Gradient dilution by loss normalization") == "i1-gradient-dilution-by-loss-normalization"
    assert _slug("The hooks' own health") == "the-hooks-own-health"
    assert _slug("Loss accounting (I1-I3)") == "loss-accounting-i1-i3"
    assert _slug("`grad_norm` and more") == "grad_norm-and-more"


# -- 1. the generated metric reference -----------------------------------------------
def test_metric_reference_is_current():
    path = ROOT / "docs" / "metrics.md"
    assert path.is_file(), f"docs/metrics.md is missing; generate it with `{REGENERATE}`"
    assert path.read_text(encoding="utf-8") == reference_markdown(), (
        f"docs/metrics.md is out of date with wire/metrics.py; regenerate it with `{REGENERATE}`"
    )


# -- 2. every document the code names exists -------------------------------------------
# A markdown file name, with the path in front of it when there is one, and an anchor.
_DOC_REF = re.compile(r"(?<![\w./-])((?:\.{1,2}/)*(?:[\w.-]+/)*[\w.-]*\w\.md)(#[\w-]+)?")


def _doc_refs() -> list[tuple[str, str, str | None]]:
    """(file:line, referenced path or name, anchor) for every ``*.md`` the code names."""
    refs = []
    for path in _code_files():
        for number, line in _lines(path):
            for m in _DOC_REF.finditer(line):
                refs.append((f"{_rel(path)}:{number}", m.group(1), (m.group(2) or "")[1:] or None))
    return refs


def test_the_scan_sees_the_references_it_checks():
    found = {ref for _, ref, _ in _doc_refs()}
    # Named in the wire package and in the rule files: if these are not seen, the
    # scan is broken and the next test would pass vacuously.
    assert {"docs/metrics.md", "RUNBOOKS.md"} <= found, sorted(found)


def test_every_document_named_in_code_rules_and_readme_exists():
    by_name: dict[str, list[Path]] = {}
    for p in _walk(ROOT):
        by_name.setdefault(p.name, []).append(p)
    problems = []
    for where, ref, anchor in _doc_refs():
        if "docs/" in ref:
            target = ROOT / ("docs/" + ref.split("docs/", 1)[1])
            if not target.is_file():
                problems.append(f"{where}: {ref} (no such file in the repository)")
                continue
            if anchor is not None and anchor not in anchors(target):
                problems.append(f"{where}: {ref}#{anchor} (no such heading in {_rel(target)})")
        elif Path(ref).name not in by_name:
            problems.append(f"{where}: {ref} (no file of that name in the repository)")
    assert not problems, "documents named but not in the repository:\n" + "\n".join(problems)


# -- 3. no citations of the design notes outside the repository -------------------------
# The design notes (DESIGN.md, INCIDENTS.md in ../shared) are not part of the
# repository; what users need from them is in docs/. Also catches the citation
# style `DESIGN "Wire format"`.
_OUTSIDE = re.compile(r"\.\./shared|DESIGN\.md|INCIDENTS\.md|\bDESIGN\b|\bINCIDENTS\b")


def test_nothing_cites_the_design_notes_outside_the_repository():
    tests = [p for p in _walk(ROOT / "tests") if p.suffix == ".py" and p.name != "test_docs.py"]
    hits = [
        f"{_rel(path)}:{number}: {line.strip()}"
        for path in [*_code_files(), *tests]
        for number, line in _lines(path)
        if _OUTSIDE.search(line)
    ]
    assert not hits, (
        "these lines cite notes that are not in the repository; point them at docs/ instead:\n" + "\n".join(hits)
    )


# Words of the project's own bookkeeping (the tracker, the design notes) say nothing to a
# reader of the repository: the docs, the code and the tests speak of the project only.
_INTERNAL = re.compile(r"\bthe issue'?s?\b|\bissue's\b|\bDESIGN's\b", re.IGNORECASE)


def test_the_repository_speaks_of_the_project_only():
    files = [*_code_files(), *(p for p in _walk(ROOT / "docs") if p.suffix == ".md")]
    files += [p for p in _walk(ROOT / "tests") if p.suffix == ".py" and p.name != "test_docs.py"]
    files += [ROOT / name for name in ("CHANGELOG.md", "CONTRIBUTING.md") if (ROOT / name).exists()]
    hits = [f"{_rel(p)}:{n}: {line.strip()}" for p in files for n, line in _lines(p) if _INTERNAL.search(line)]
    assert not hits, "say what the project does or needs, not what a tracker asked:\n" + "\n".join(hits)


# -- 4. links inside the docs and the runbooks --------------------------------------
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _linked_docs() -> list[Path]:
    return [*sorted((ROOT / "docs").glob("*.md")), ROOT / "alerts" / "RUNBOOKS.md"]


def test_the_docs_exist():
    names = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert {"README.md", "incidents.md", "signals.md", "metrics.md", "wire.md", "rules.md"} <= names


@pytest.mark.parametrize("doc", _linked_docs(), ids=lambda p: _rel(p))
def test_relative_links_resolve(doc: Path):
    problems = []
    links = 0
    for number, line in _outside_fences(doc.read_text(encoding="utf-8")):
        for m in _LINK.finditer(line):
            href = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", href):  # http:, https:, mailto:
                continue
            links += 1
            target_part, _, anchor = href.partition("#")
            target = (doc.parent / target_part).resolve() if target_part else doc
            where = f"{_rel(doc)}:{number}: ({href})"
            if not target.exists():
                problems.append(f"{where}: no such file")
            elif anchor and target.suffix == ".md" and anchor not in anchors(target):
                problems.append(f"{where}: no heading with anchor #{anchor} in {target.name}")
    assert not problems, "broken links:\n" + "\n".join(problems)
    assert links, f"{_rel(doc)} links nowhere: is the link pattern still right?"


# -- the license the package declares ---------------------------------------------------
def test_license_file_is_the_apache_2_license_pyproject_declares():
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    for part in (
        "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION",
        "9. Accepting Warranty or Additional Liability.",
        "END OF TERMS AND CONDITIONS",
        "APPENDIX: How to apply the Apache License to your work.",
    ):
        assert part in text, part


def test_wire_doc_lists_every_event_kind():
    from trainvitals.wire.schema import EVENT_KINDS

    text = (ROOT / "docs" / "wire.md").read_text()
    missing = [kind for kind in EVENT_KINDS if f"`{kind}`" not in text]
    assert not missing, f"docs/wire.md does not list the event kind(s) {missing} (EVENT_KINDS in wire/schema.py)"


def test_the_readme_ci_and_skip_reasons_name_the_same_system_packages():
    """The tests that need system tools skip naming an apt-get line; the README tells a
    contributor the same packages, and .ci/run installs them."""
    packages = TEST_TOOLS_INSTALL.removeprefix("apt-get install ").split()
    assert packages == ["prometheus", "prometheus-alertmanager", "chromium"], TEST_TOOLS_INSTALL
    readme = (ROOT / "README.md").read_text()
    assert f"apt-get update && apt-get install -y {' '.join(packages)}" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"apt-get install -y --no-install-recommends {' '.join(packages)}" in ci
