"""The collector's pages: ``GET /`` (the runs, their state, firing alerts and past incidents) and
``GET /runs/{run}`` (the report page of one run, :mod:`trainvitals.monitor.report_page`,
updating as reports arrive: the page refetches ``/runs/{run}?format=json``).

:class:`LivePages` sees every accepted batch (``store.on_ingest``) and keeps, per run,
the verdict (:class:`~trainvitals.alerts.verdict.VerdictBuilder`, the same rules as the
collector's alerts) and the plotted series, bounded (:class:`RunHistory`), for at most
:data:`MAX_RUNS` runs (the least recently updated is forgotten first). The read token applies to these pages as to
``/v1/*``; a browser can give it as the password of HTTP Basic authentication (any
user name), which these pages ask for. Not in the OpenAPI document: pages, not API.
"""

from __future__ import annotations

import html
import threading
import time
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse

from trainvitals.alerts.service import AlertService
from trainvitals.alerts.verdict import Incident, VerdictBuilder
from trainvitals.monitor.lifetime import judging
from trainvitals.monitor.report_page import RunHistory, page_data, render_page
from trainvitals.wire.errors import Refused

__all__ = ["LivePages", "install", "router"]

router = APIRouter(include_in_schema=False)

MAX_RUNS = 200
"""Runs whose history the pages keep (the oldest updated is dropped first)."""


class LivePages:
    """Verdicts and plotted series of the live runs, fed by the collector's alert service
    (``AlertService.on_observed``: every accepted report with its evaluation)."""

    def __init__(self, rules: Any = "default", *, alerts: AlertService | None = None) -> None:
        """``alerts``: the collector's alert service, whose evaluation of each report the
        verdicts are read from (:meth:`observed`; the rules run once per report, not
        twice); without it, the pages evaluate ``rules`` themselves (:meth:`observe_batch`)."""
        self._rules = rules
        self._lock = threading.Lock()
        self.builder = VerdictBuilder(rules, engine=None if alerts is None else alerts.engine)
        self.history = RunHistory(rules=self.builder.rules)

    def observe_batch(self, batch: Any, now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._lock:
            for report in batch.reports:
                self.builder.observe(report, now)
                self.history.add(report)
            self._bound(now)

    def observed(self, report: Any, transitions: list[Any]) -> None:
        """A report as the alert service evaluated it (``AlertService.on_observed``)."""
        with self._lock:
            self.builder.record(report, transitions)
            if report is not None:
                self.history.add(report)
                self._bound(time.time())

    def _bound(self, now: float) -> None:
        if len(self.history.runs) > MAX_RUNS:
            oldest = sorted(self.history.updated, key=self.history.updated.__getitem__)
            for run in oldest[: len(self.history.runs) - MAX_RUNS]:
                self.history.forget(run)
                self.builder.forget(run, now)

    def known(self, run: str) -> bool:
        with self._lock:
            return run in self.history.runs

    def incidents(self, run: str) -> list[Incident] | None:
        """The run's incidents (fired, resolved, firing when it ended), from its verdict;
        None when the pages do not keep the run (past :data:`MAX_RUNS`)."""
        with self._lock:
            if run not in self.history.runs:
                return None
            return list(self.builder.verdict(run).incidents)

    def data(self, run: str) -> dict[str, Any]:
        with self._lock:
            return page_data(self.builder, self.history, [run])

    def page(self, run: str, live_url: str) -> str:
        with self._lock:
            return render_page(self.builder, self.history, title=f"run {run}", runs=[run], live_url=live_url, nav=_NAV)


_NAV = '<nav><a href="/">all runs</a></nav>'


def install(app: FastAPI) -> LivePages:
    """Feed the pages from the app's store and serve them."""
    settings = app.state.settings
    alerts = getattr(app.state, "alerts", None)
    if isinstance(alerts, AlertService):
        pages = LivePages(alerts=alerts)
        alerts.on_observed(pages.observed)  # every accepted report reaches the alerts
    else:
        pages = LivePages("default" if settings.rules is None else settings.rules)
        # judging drift over the run's life, as the alerts do
        app.state.store.on_ingest(judging(pages.observe_batch))
    app.state.pages = pages
    app.include_router(router)
    return pages


def _pages(request: Request) -> LivePages:
    pages: LivePages = request.app.state.pages
    return pages


_INDEX_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:10px 20px}h1{font-size:18px;margin:0}main{padding:10px 20px}
table{border-collapse:collapse;background:#fff;width:100%}th,td{text-align:left;padding:6px 10px;
border-bottom:1px solid #eceff3}.page{color:#b3261e;font-weight:700}.warning{color:#9a6100;font-weight:700}
.ok{color:#1c5b2a}.silent{color:#7a4b00}.note{color:#666}
"""


def _labels_text(labels: Any) -> str:
    return ", ".join(f"{k}={v}" for k, v in labels.items() if k != "run")


def _incident_text(inc: Incident) -> str:
    """``resolved: GradientDilution (modality=image, steps 21-26)``."""
    state = "resolved" if inc.resolved else ("firing when the run ended" if inc.ended_firing else "firing")
    where = _labels_text(inc.labels)
    steps = f"step {inc.first_step}" if inc.first_step == inc.last_step else f"steps {inc.first_step}-{inc.last_step}"
    again = f", fired {inc.fired} times" if inc.fired > 1 else ""
    return (
        f'{html.escape(state)}: <span class="{html.escape(inc.severity)}">{html.escape(inc.alert)}</span>'
        f" ({html.escape(where + ', ' if where else '')}{steps}{again})"
    )


@router.get("/", response_class=HTMLResponse)
async def index(request: Request) -> HTMLResponse:
    """The runs the collector knows: state, last step, their alerts (firing now, and the
    incidents they had: resolved, or firing when the run ended), a link to each page."""
    now = time.time()
    store = request.app.state.store
    pages = _pages(request)
    firing: dict[str, list[Any]] = {}
    for alert in request.app.state.alerts.engine.firing():
        firing.setdefault(alert.labels.get("run", ""), []).append(alert)
    rows = []
    for r in store.runs(now):
        age = now - r.last_report_time
        state = "ended" if r.ended else ("reporting" if age < 120 else f"silent for {int(age)} s")
        alerts = sorted(firing.get(r.run, []), key=lambda a: (a.severity != "page", a.alertname))
        shown = [
            f'<span class="{html.escape(a.severity)}">{html.escape(a.alertname)}</span>'
            + (f" ({html.escape(_labels_text(a.labels))})" if len(a.labels) > 1 else "")
            for a in alerts
        ]
        # What fired before (resolved, or still firing when the run ended): the run's
        # verdict, as its page shows it; an alert firing now is listed once, above.
        now_firing = {(a.alertname, _labels_text(a.labels)) for a in alerts}
        incidents = pages.incidents(r.run)
        if incidents is None:
            shown.append('<span class="note">earlier incidents not kept (too many runs)</span>')
        else:
            shown += [_incident_text(i) for i in incidents if (i.alert, _labels_text(i.labels)) not in now_firing]
        rows.append(
            f'<tr class="run" data-run="{html.escape(r.run)}"><td><a href="/runs/{quote(r.run, safe="/:")}">'
            f"{html.escape(r.run)}</a></td><td>{r.step}</td>"
            f'<td class="{"silent" if state.startswith("silent") else "ok"}">{html.escape(state)}</td>'
            f'<td class="alerts">{"; ".join(shown) or "<span class=ok>none</span>"}</td></tr>'
        )
    table = (
        "<table><tr><th>run</th><th>step</th><th>state</th><th>alerts</th></tr>" + "".join(rows) + "</table>"
        if rows
        else "<p>No run has reported yet.</p>"
    )
    body = (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">"
        '<meta http-equiv="refresh" content="10">'
        f"<title>trainvitals collector</title><style>{_INDEX_STYLE}</style></head><body>"
        f"<header><h1>trainvitals collector: {len(rows)} run(s)</h1></header><main>{table}</main></body></html>"
    )
    return HTMLResponse(body)


@router.get("/runs/{run:path}", response_model=None)
async def run_page(request: Request, run: str, format: str = "html") -> HTMLResponse | JSONResponse:
    """One run's report page (``?format=json``: the data it draws)."""
    pages = _pages(request)
    if not pages.known(run):
        raise Refused(f"no run {run!r} has reported to this collector (or it expired)", status=404)
    if format == "json":
        return JSONResponse(pages.data(run), headers={"Cache-Control": "no-store"})
    if format != "html":
        raise Refused("format: use html or json", status=400)
    live = f"/runs/{quote(run, safe='/:')}?format=json"
    return HTMLResponse(pages.page(run, live))
