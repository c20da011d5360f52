"""The report page: one self-contained HTML file per set of runs.

``trainvitals report FILE.jsonl -o report.html`` writes it from recorded reports;
the collector serves the same page for a live run (``/runs/{run}``,
:mod:`trainvitals.monitor.routes_pages`). A section per run: the verdict on top
(:mod:`trainvitals.alerts.verdict`, the same computation as ``trainvitals check``
and the job's close), the incident timeline, then plots of the signals behind
each alert with the rule's thresholds drawn.

Plots are drawn in the browser by uPlot (MIT, vendored in ``static/``), inlined
with its stylesheet, the page's own script and the data; a Content-Security-Policy
in the page forbids every request (the live page may fetch from the collector
that served it, nothing else). Nothing to install or fetch: the file can be
mailed and opened offline.

Size: each series keeps at most :data:`MAX_BUCKETS` buckets of its steps, each with
the lowest and the highest value seen in it (an envelope: a spike or a dip stays
visible), and a plot draws at most :data:`MAX_SERIES` series of a metric, the most
extreme first (the series of an incident always); the page says how many it left
out. A 10,000-step run with 200 series gives well under a few MB
(``tests/benchmarks/bench_report_page.py``).
"""

from __future__ import annotations

import html
import json
import math
import time
from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from trainvitals.alerts.model import ThresholdRule
from trainvitals.alerts.verdict import RunVerdict, VerdictBuilder
from trainvitals.alerts.verdict_text import format_value
from trainvitals.monitor.series import Labels

__all__ = ["MAX_BUCKETS", "MAX_SERIES", "PANELS", "Panel", "RunHistory", "page_data", "render_page"]

MAX_BUCKETS = 1000
"""Buckets kept per series (each a step range with its min and max value)."""

MAX_SERIES = 8
"""Series drawn per metric in one plot (incident series first, then the most extreme)."""


@dataclass(frozen=True)
class Panel:
    """One plot: metrics drawn together, with the thresholds of the rules on them."""

    key: str
    title: str
    metrics: tuple[str, ...]
    log: bool = False


PANELS: tuple[Panel, ...] = (
    Panel(
        "dilution",
        "Modality dilution (sample share / gradient share) and its excess over the intended normalization",
        ("modality_excess_dilution_ratio", "modality_dilution_ratio"),
    ),
    Panel(
        "grad_share",
        "Per-modality share of samples and of gradient weight",
        ("modality_sample_share_ratio", "modality_grad_share_ratio"),
    ),
    Panel(
        "loss_mass",
        "Loss weight mass per optimizer step and its accumulation exponent",
        ("loss_weight_mass", "loss_accumulation_exponent"),
    ),
    Panel("spread", "Token weight spread across the micro-batches of a step", ("token_weight_spread_ratio",)),
    Panel("drift", "1D parameter drift (bits since attach)", ("param_drift_log2",)),
    Panel("adam_eps", "Share of Adam's denominator dominated by eps", ("adam_eps_dominated_ratio",)),
    Panel("softmax", "Softmax saturation (share of positions above the threshold)", ("softmax_saturated_ratio",)),
    Panel("grad_norm", "Gradient norm before clipping, and its max between reports", ("grad_norm", "grad_norm_max")),
    Panel("loss", "Loss", ("loss", "modality_loss")),
)

_PLOTTED = frozenset(m for p in PANELS for m in p.metrics)


class _Series:
    """One series' history: bucket start steps, min and max values (float64 arrays)."""

    __slots__ = ("_n", "hi", "lo", "per_bucket", "steps")

    def __init__(self) -> None:
        self.steps = array("d")
        self.lo = array("d")
        self.hi = array("d")
        self.per_bucket = 1  # reports merged into one bucket
        self._n = 0  # reports in the last bucket

    def add(self, step: float, value: float) -> None:
        if self._n and self._n < self.per_bucket:
            self._n += 1
            if value < self.lo[-1] or self.lo[-1] != self.lo[-1]:
                self.lo[-1] = value
            if value > self.hi[-1] or self.hi[-1] != self.hi[-1]:
                self.hi[-1] = value
            return
        self.steps.append(step)
        self.lo.append(value)
        self.hi.append(value)
        self._n = 1
        if len(self.steps) > MAX_BUCKETS:
            self._halve()

    def _halve(self) -> None:
        """Merge neighbouring buckets in pairs (min of mins, max of maxes)."""
        old_len, old_per = len(self.steps), self.per_bucket
        steps, lo, hi = array("d"), array("d"), array("d")
        for i in range(0, len(self.steps), 2):
            j = min(i + 1, len(self.steps) - 1)
            steps.append(self.steps[i])
            lo.append(_nanmin(self.lo[i], self.lo[j]))
            hi.append(_nanmax(self.hi[i], self.hi[j]))
        self.steps, self.lo, self.hi = steps, lo, hi
        self.per_bucket = old_per * 2
        # The last bucket: a lone old one (odd count) or two merged ones.
        self._n = self._n if old_len % 2 else old_per + self._n

    def extreme(self, below: bool) -> float:
        vals = [v for v in (self.lo if below else self.hi) if v == v]
        if not vals:
            return math.nan
        return min(vals) if below else max(vals)


def _nanmin(a: float, b: float) -> float:
    return b if a != a else (a if b != b else min(a, b))


def _nanmax(a: float, b: float) -> float:
    return b if a != a else (a if b != b else max(a, b))


class RunHistory:
    """The plotted metrics' series of each run, bounded (see the module's "Size")."""

    def __init__(self, metrics: Iterable[str] = _PLOTTED) -> None:
        self.metrics = frozenset(metrics)
        # run -> metric -> label items -> series
        self.runs: dict[str, dict[str, dict[tuple[tuple[str, str], ...], _Series]]] = {}
        self.updated: dict[str, float] = {}

    def add(self, report: Any) -> None:
        """One report (a wire Report, or the collector decoder's struct)."""
        run = self.runs.get(report.run)
        if run is None:
            run = self.runs[report.run] = {}
        step = float(report.step)
        wanted = self.metrics
        rank = ("rank", str(report.rank)) if report.rank else None
        isfinite = math.isfinite
        for sample in report.samples:
            name = sample.name
            if name not in wanted:
                continue
            labels = sample.labels
            if rank is not None:
                key = tuple(sorted([*labels.items(), rank]))
            elif labels.__class__ is Labels:  # the decoder's shared labels: the store's key
                key = labels.key
            else:  # as the store keys them: sorted label items, without copying the dict
                key = tuple(labels.items()) if len(labels) < 2 else tuple(sorted(labels.items()))
            per_metric = run.get(name)
            if per_metric is None:
                per_metric = run[name] = {}
            series = per_metric.get(key)
            if series is None:
                series = per_metric[key] = _Series()
            value = float(sample.value)
            series.add(step, value if isfinite(value) else math.nan)
        self.updated[report.run] = time.time()

    def forget(self, run: str) -> None:
        self.runs.pop(run, None)
        self.updated.pop(run, None)


def _label_text(metric: str, key: tuple[tuple[str, str], ...]) -> str:
    inner = ", ".join(f"{k}={v}" for k, v in key)
    return f"{metric}{{{inner}}}" if inner else metric


def _thresholds(rules: Iterable[Any], metric: str) -> list[dict[str, Any]]:
    out = []
    for rule in rules:
        if isinstance(rule, ThresholdRule) and rule.metric == metric:
            bound = rule.above if rule.above is not None else rule.below
            out.append(
                {
                    "alert": rule.alert,
                    "value": bound,
                    "kind": "above" if rule.above is not None else "below",
                    "clear": rule.clear_at,
                    "severity": rule.severity,
                    "metric": metric,
                }
            )
        for cond in getattr(rule, "and_", ()) or ():
            if cond.metric == metric:
                for kind in ("above", "below"):
                    bound = getattr(cond, kind, None)
                    if bound is not None:
                        out.append(
                            {
                                "alert": rule.alert,
                                "value": bound,
                                "kind": kind,
                                "clear": None,
                                "severity": rule.severity,
                                "metric": metric,
                                "condition": True,
                            }
                        )
    return out


def _panel_data(
    panel: Panel, metrics: Mapping[str, Any], verdict: RunVerdict, rules: list[Any]
) -> dict[str, Any] | None:
    wanted_keys = {(i.metric, tuple(sorted(i.labels.items()))) for i in verdict.incidents if i.metric in panel.metrics}
    chosen: list[tuple[str, tuple[Any, ...], _Series]] = []
    left_out = 0
    for metric in panel.metrics:
        per = metrics.get(metric)
        if not per:
            continue
        below = any(t["kind"] == "below" and not t.get("condition") for t in _thresholds(rules, metric))
        ranked = sorted(
            per.items(),
            key=lambda kv: (
                (metric, kv[0]) not in wanted_keys,
                -(_finite(kv[1].extreme(below)) * (-1 if below else 1)),
            ),
        )
        chosen.extend((metric, k, s) for k, s in ranked[:MAX_SERIES])
        left_out += max(0, len(ranked) - MAX_SERIES)
    if not chosen:
        return None
    # One x axis: every bucket start of the chosen series, and a point just after it for
    # the bucket's max when the bucket holds more than one report.
    xs: set[float] = set()
    for _, _, s in chosen:
        xs.update(s.steps)
        if s.per_bucket > 1:
            xs.update(x + 0.5 * s.per_bucket for x in s.steps)
    x = sorted(xs)
    index = {v: i for i, v in enumerate(x)}
    columns: list[list[float | None]] = []
    for _, _, s in chosen:
        col: list[float | None] = [None] * len(x)
        for st, lo, hi in zip(s.steps, s.lo, s.hi, strict=True):
            if s.per_bucket > 1:
                col[index[st]] = _num(lo)
                col[index[st + 0.5 * s.per_bucket]] = _num(hi)
            else:
                col[index[st]] = _num(lo)
        columns.append(col)
    return {
        "key": panel.key,
        "title": panel.title,
        "x": [_num(v) for v in x],
        "series": [
            {"label": _label_text(m, k), "metric": m, "incident": (m, k) in wanted_keys, "values": c}
            for (m, k, _), c in zip(chosen, columns, strict=True)
        ],
        "thresholds": [t for m in panel.metrics if m in metrics for t in _thresholds(rules, m)],
        "left_out": left_out,
    }


def _finite(v: float) -> float:
    return v if v == v and not math.isinf(v) else (-math.inf if v != v else v)


def _num(v: float) -> float | None:
    if v != v or math.isinf(v):
        return None
    return float(f"{v:.6g}")


def page_data(builder: VerdictBuilder, history: RunHistory, runs: Iterable[str] | None = None) -> dict[str, Any]:
    """What the page's script draws: per run, the verdict and the plots' data."""
    out = []
    verdicts = {v.run: v for v in builder.verdicts()}
    names = list(runs) if runs is not None else list(verdicts)
    for run in names:
        verdict = verdicts.get(run) or RunVerdict(run)
        metrics = history.runs.get(run, {})
        panels = [p for p in (_panel_data(panel, metrics, verdict, builder.rules) for panel in PANELS) if p]
        out.append({"verdict": verdict.as_dict(), "panels": panels})
    return {"runs": out, "generated": time.time()}


@lru_cache(maxsize=1)
def _static() -> tuple[str, str, str, str]:
    """uPlot's script and style, the page's own script and style (``static/``)."""
    folder = resources.files("trainvitals.monitor").joinpath("static")
    names = ("uPlot.iife.min.js", "uPlot.min.css", "report.js", "report.css")
    js, css, own_js, own_css = (folder.joinpath(n).read_text(encoding="utf-8") for n in names)
    return js, css, own_js, own_css


def _json_for_script(obj: Any) -> str:
    """JSON that cannot close its ``<script>`` element."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c").replace(">", "\\u003e")


def render_page(
    builder: VerdictBuilder,
    history: RunHistory,
    *,
    title: str,
    runs: Iterable[str] | None = None,
    live_url: str | None = None,
    nav: str = "",
) -> str:
    """The page. ``live_url``: where the page fetches fresh data (the collector's page of
    a live run; the CSP then allows that origin only), else nothing is ever fetched."""
    js, css, own_js, own_css = _static()
    data = page_data(builder, history, runs)
    connect = "'self'" if live_url else "'none'"
    csp = (
        f"default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        f"img-src data:; connect-src {connect}; base-uri 'none'; form-action 'none'"
    )
    verdicts = [r["verdict"] for r in data["runs"]]
    pages = sum(1 for v in verdicts for i in v["incidents"] if i["severity"] == "page")
    summary = (
        f"{len(verdicts)} run(s); "
        + (f"{pages} page-severity incident(s)" if pages else "no page-severity incident")
        + f"; generated {time.strftime('%Y-%m-%d %H:%M:%S %Z')}"
    )
    fallback = "".join(
        f"<li>{html.escape(v['run'])}: {len(v['incidents'])} incident(s) in {v['reports']} reports"
        + "".join(
            f" | {html.escape(i['alert'])} {html.escape(i['severity'])} steps {i['first_step']}-{i['last_step']}"
            f" peak {format_value(i['peak'] if i['peak'] is not None else math.nan)}"
            for i in v["incidents"]
        )
        + "</li>"
        for v in verdicts
    )
    live_attr = f' data-live="{html.escape(live_url)}"' if live_url else ""
    return (
        "<!doctype html>\n<html lang=en><head><meta charset=utf-8>"
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
        '<meta name=viewport content="width=device-width, initial-scale=1">'
        f"<title>trainvitals report: {html.escape(title)}</title>"
        f"<style>{css}</style><style>{own_css}</style></head>"
        f"<body{live_attr}><header><h1>trainvitals report: {html.escape(title)}</h1>"
        f'<p>{html.escape(summary)} <span id="updated"></span></p></header>'
        f"<main>{nav}<noscript><ul>{fallback}</ul></noscript><div id=runs></div></main>"
        f'<script id="report-data" type="application/json">{_json_for_script(data)}</script>'
        f"<script>{js}</script><script>{own_js}</script></body></html>\n"
    )
