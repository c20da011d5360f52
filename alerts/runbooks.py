"""The runbooks the collector serves: ``alerts/RUNBOOKS.md``, one page per alert.

Each ``## AlertName`` section of the file is one runbook; its anchor is the
lower-cased heading (``RUNBOOKS.md#gradientdilution``, what the default rules
name). The collector serves ``GET /runbooks`` (every section, each under its
anchor) and ``GET /runbooks/{anchor}`` (that alert's section alone), rendered to
HTML with markdown-it; notifications carry the absolute URL of the page
(:func:`runbook_url`). Links inside the file that point into the repository's
``docs/`` become plain text targets there; the page says where the docs live.
"""

from __future__ import annotations

import functools
import html
import re
from dataclasses import dataclass
from importlib import resources
from urllib.parse import quote

__all__ = [
    "RUNBOOK_FILE",
    "Runbook",
    "render_index",
    "render_page",
    "runbook_for",
    "runbook_url",
    "runbooks",
]

RUNBOOK_FILE = "RUNBOOKS.md"
_HEADING = re.compile(r"^## +(\S.*?)\s*$")


@dataclass(frozen=True)
class Runbook:
    """One section of the runbook file."""

    title: str
    """The heading: the alert's name."""
    anchor: str
    """Lower-cased title: the fragment the rules name and the page's path."""
    markdown: str
    """The section's text, heading included."""


def _parse(text: str) -> tuple[str, dict[str, Runbook]]:
    intro: list[str] = []
    sections: dict[str, Runbook] = {}
    title: str | None = None
    body: list[str] = []

    def close() -> None:
        if title is not None:
            anchor = title.lower()
            if anchor in sections:
                raise ValueError(f"{RUNBOOK_FILE}: two sections named {title!r}")
            sections[anchor] = Runbook(title, anchor, "\n".join(body).strip() + "\n")

    for line in text.splitlines():
        m = _HEADING.match(line)
        if m:
            close()
            title, body = m.group(1), [line]
        elif title is None:
            intro.append(line)
        else:
            body.append(line)
    close()
    return "\n".join(intro).strip() + "\n", sections


@functools.lru_cache(maxsize=1)
def _loaded() -> tuple[str, dict[str, Runbook]]:
    text = resources.files("trainvitals.alerts").joinpath(RUNBOOK_FILE).read_text(encoding="utf-8")
    return _parse(text)


def runbooks() -> dict[str, Runbook]:
    """Every runbook of the shipped file, by anchor."""
    return dict(_loaded()[1])


def runbook_for(reference: str) -> Runbook | None:
    """The shipped runbook a rule's ``runbook:`` names (``RUNBOOKS.md#paramdrift``, or the
    bare anchor or alert name); None when it names something else."""
    ref = reference.strip()
    if ref.startswith(("http://", "https://")):
        return None
    if "#" in ref:
        path, _, anchor = ref.partition("#")
        if path and path.rsplit("/", 1)[-1] != RUNBOOK_FILE:
            return None
    else:
        anchor = ref
    return _loaded()[1].get(anchor.lower())


def runbook_url(reference: str, external_url: str, base_url: str | None = None) -> str:
    """The absolute link a notification carries for a rule's ``runbook:``.

    An http(s) URL stays as it is; with ``base_url`` (``alerts.runbook_base_url``: the
    runbooks live elsewhere, a wiki) a relative reference is joined to it; a section of
    the shipped file becomes the collector's page ``{external_url}/runbooks/{anchor}``;
    anything else stays as written.
    """
    if not reference or reference.startswith(("http://", "https://")):
        return reference
    if base_url:
        return base_url.rstrip("/") + "/" + reference.lstrip("/")
    book = runbook_for(reference)
    if book is None or not external_url:
        return reference
    return f"{external_url.rstrip('/')}/runbooks/{quote(book.anchor, safe='')}"


_DOCS_LINK = re.compile(r"\]\(\.\./docs/([^)#\s]+)(#[^)\s]*)?\)")


def _markdown_html(text: str) -> str:
    from markdown_it import MarkdownIt  # the collector only: the hooks never render pages

    # Links into the repository's docs cannot open from the collector: show the path.
    text = _DOCS_LINK.sub(lambda m: f"] (docs/{m.group(1)}{m.group(2) or ''})", text)
    md = MarkdownIt("commonmark", {"html": False, "linkify": False})
    return str(md.render(text))


_STYLE = (
    "body{font-family:system-ui,sans-serif;max-width:48rem;margin:2rem auto;padding:0 1rem;line-height:1.5}"
    "code{background:#f3f3f3;padding:0 .2em}h2{border-bottom:1px solid #ddd}"
)


def _page(title: str, body: str) -> str:
    return (
        "<!doctype html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head>\n<body>\n{body}</body></html>\n"
    )


def render_page(anchor: str) -> str | None:
    """The HTML page of one alert's runbook (``anchor`` or the alert's name, any case);
    None when there is none."""
    book = _loaded()[1].get(anchor.lower())
    if book is None:
        return None
    body = f"<article id='{html.escape(book.anchor)}'>\n{_markdown_html(book.markdown)}</article>\n"
    body += "<p><a href='../runbooks'>All runbooks</a></p>\n"
    return _page(f"Runbook: {book.title}", body)


def render_index() -> str:
    """Every runbook on one page, each section under its anchor."""
    intro, sections = _loaded()
    parts = [_markdown_html(intro), "<ul>"]
    for book in sections.values():
        parts.append(f"<li><a href='#{html.escape(book.anchor)}'>{html.escape(book.title)}</a></li>")
    parts.append("</ul>")
    for book in sections.values():
        parts.append(f"<section id='{html.escape(book.anchor)}'>\n{_markdown_html(book.markdown)}</section>")
    return _page("trainvitals runbooks", "\n".join(parts) + "\n")
