"""The report page: one self-contained HTML file per set of runs.

``trainvitals report FILE.jsonl -o report.html`` writes it from recorded reports;
the collector serves the same page for a live run (``/runs/{run}``,
:mod:`trainvitals.monitor.routes_pages`). A section per run: the verdict on top
(:mod:`trainvitals.alerts.verdict`, the same computation as ``trainvitals check``
and the job's close), the incident timeline, then plots of the signals behind
each alert with the rule's thresholds drawn.

Thresholds: only a threshold on the plotted scale is a constant line (a rule or an
``and`` condition on the metric's value as reported; a rule with label matchers says
which series it is for when the plot shows others). A rule on the value over its
series' own median (``ratio_to_median``, GradNormSpike) is drawn as a series in the
metric's unit, the median times the rule's factor, computed as the engine computes it
(:class:`RunHistory`); any other transform is not drawn, and the plot's caption says
so. The labels are elements over the plot, laid out in the browser so that no two
overlap (``static/report.js``).

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

from trainvitals.alerts.model import Condition, Matcher, ThresholdRule
from trainvitals.alerts.rule_index import compile_matchers
from trainvitals.alerts.transforms import SeriesHistory
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
        "Modality dilution in excess of the intended normalization (the share it intends / the share it gets)",
        ("modality_excess_dilution_ratio",),
    ),
    Panel("dilution_ratio", "Modality dilution (sample share / gradient share)", ("modality_dilution_ratio",)),
    Panel(
        "grad_share",
        "Per-modality share of samples and of gradient weight",
        ("modality_sample_share_ratio", "modality_grad_share_ratio"),
    ),
    Panel("loss_mass", "Loss weight mass per optimizer step", ("loss_weight_mass",)),
    Panel(
        "loss_exponent",
        "Accumulation exponent of the loss weight mass (log mass / log micro-batches)",
        ("loss_accumulation_exponent",),
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
    """The plotted metrics' series of each run, bounded (see the module's "Size").

    ``rules``: the rules the page draws (the verdict's). A ``ratio_to_median`` rule's
    threshold is not a constant on the metric's scale: for each series it watches, the
    history keeps the median the rule divides each value by, computed as the engine
    does (:meth:`~trainvitals.alerts.transforms.SeriesHistory.median_step`, fed the
    same reports in the same order), so the page draws the rule's threshold as a line
    in the metric's unit. Without the rules no such line can be drawn, and the page says so.
    """

    def __init__(self, metrics: Iterable[str] = _PLOTTED, rules: Iterable[Any] = ()) -> None:
        self.metrics = frozenset(metrics)
        # run -> metric -> label items -> series
        self.runs: dict[str, dict[str, dict[tuple[tuple[str, str], ...], _Series]]] = {}
        self.updated: dict[str, float] = {}
        # ratio_to_median rules on a plotted metric: metric -> [(position, rule, label predicate)]
        self.rules: list[Any] = list(rules)
        self._ratio: dict[str, list[tuple[int, ThresholdRule, Any]]] = {}
        for i, rule in enumerate(self.rules):
            if isinstance(rule, ThresholdRule) and rule.transform == "ratio_to_median" and rule.metric in self.metrics:
                self._ratio.setdefault(rule.metric, []).append((i, rule, compile_matchers(rule.labels)))
        self._medians = SeriesHistory()
        # run -> (rule position, series key) -> the rule's median before each report
        self.baselines: dict[str, dict[tuple[int, tuple[tuple[str, str], ...]], _Series]] = {}

    def add(self, report: Any) -> None:
        """One report (a wire Report, or the collector decoder's struct)."""
        run = self.runs.get(report.run)
        if run is None:
            run = self.runs[report.run] = {}
        step = float(report.step)
        wanted = self.metrics
        ratio = self._ratio
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
            if name in ratio:
                self._baseline(report, ratio[name], labels, key, step, value)
        self.updated[report.run] = time.time()

    def _baseline(
        self,
        report: Any,
        rules: list[tuple[int, ThresholdRule, Any]],
        labels: Any,
        key: tuple[tuple[str, str], ...],
        step: float,
        raw: float,
    ) -> None:
        for i, rule, match in rules:
            if not match(labels):  # the series the rule watches, matched as the engine does
                continue
            # The median the engine divides this value by (its key: rule, run, rank, labels).
            med = self._medians.median_step(rule, (i, report.run, report.rank, key), raw)
            if med is None:  # fewer than min_history reports: no verdict yet, no line
                continue
            per_run = self.baselines.setdefault(report.run, {})
            line = per_run.get((i, key))
            if line is None:
                line = per_run[(i, key)] = _Series()
            line.add(step, med if med > 0 else math.nan)

    def forget(self, run: str) -> None:
        self.runs.pop(run, None)
        self.updated.pop(run, None)
        self.baselines.pop(run, None)
        self._medians.forget_run(run)


def _label_text(metric: str, key: tuple[tuple[str, str], ...]) -> str:
    inner = ", ".join(f"{k}={v}" for k, v in key)
    return f"{metric}{{{inner}}}" if inner else metric


def _matchers_text(matchers: Iterable[Matcher]) -> str:
    return ", ".join(f"{m.name}{'=' if m.op == '=' else m.op}{m.value}" for m in matchers)


def _applies(matchers: tuple[Matcher, ...], drawn: list[tuple[tuple[str, str], ...]]) -> tuple[bool, str | None]:
    """Whether a threshold with label ``matchers`` applies to any drawn series of its metric,
    and, when only to some, which (``threshold=0.99``: the line is not the others')."""
    if not matchers:
        return True, None
    match = compile_matchers(matchers)
    hits = [match(dict(kv for kv in key if kv[0] != "rank")) for key in drawn]
    if not any(hits):
        return False, None
    return True, None if all(hits) else _matchers_text(matchers)


def _constant(rule: ThresholdRule, cond: Condition | None, metric: str, kind: str, only: str | None) -> dict[str, Any]:
    src = cond if cond is not None else rule
    return {
        "alert": rule.alert,
        "value": getattr(src, kind),
        "kind": kind,
        # No second line where the rule clears at its threshold (no hysteresis).
        "clear": None if cond is not None or rule.clear_at == rule.threshold else rule.clear_at,
        "severity": rule.severity,
        "metric": metric,
        "condition": cond is not None,
        "only": only,
    }


def _thresholds(
    rules: Iterable[Any], metric: str, drawn: list[tuple[tuple[str, str], ...]]
) -> tuple[list[dict[str, Any]], list[tuple[ThresholdRule, str]]]:
    """The constant thresholds on ``metric`` (drawn as horizontal lines), and the rules on it
    whose threshold is not a constant of the metric's scale, with what they compare."""
    out: list[dict[str, Any]] = []
    other: list[tuple[ThresholdRule, str]] = []
    for rule in rules:
        if not isinstance(rule, ThresholdRule):
            continue
        if rule.metric == metric:
            ok, only = _applies(rule.labels, drawn)
            if ok and rule.transform == "value":
                out.append(_constant(rule, None, metric, "above" if rule.above is not None else "below", only))
            elif ok:
                other.append((rule, only or ""))
        for cond in rule.and_:
            if cond.metric == metric:
                # A condition reads the metric's value as reported, whatever the rule's transform.
                ok, only = _applies(cond.labels, drawn)
                if ok:
                    out.append(_constant(rule, cond, metric, "above" if cond.above is not None else "below", only))
    return out, other


def _ratio_note(rule: ThresholdRule, metric: str) -> str:
    kind = "above" if rule.above is not None else "below"
    clears = (
        f", clears at {format_value(rule.clear)} x" if rule.clear is not None and rule.clear != rule.threshold else ""
    )
    return (
        f"{rule.alert} compares {metric} to its median over the previous {rule.window} reports, from the "
        f"{_ordinal(rule.history_needed + 1)} report on: its threshold moves with the series and is drawn as one "
        f"(fires {kind} {format_value(rule.threshold)} x the median{clears})"
    )


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _panel_data(
    panel: Panel, metrics: Mapping[str, Any], verdict: RunVerdict, rules: list[Any], history: RunHistory, run: str
) -> dict[str, Any] | None:
    wanted_keys = {(i.metric, tuple(sorted(i.labels.items()))) for i in verdict.incidents if i.metric in panel.metrics}
    chosen: list[tuple[str, tuple[Any, ...], _Series]] = []
    left_out = 0
    for metric in panel.metrics:
        per = metrics.get(metric)
        if not per:
            continue
        below = any(
            r.metric == metric and r.below is not None and r.transform == "value"
            for r in rules
            if isinstance(r, ThresholdRule)
        )
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
    # The rules' thresholds: constants of the plotted scale as horizontal lines; a rule on a
    # ratio to the series' own median as a line per series it watches, in the metric's unit
    # (the median times the rule's factor, as the engine computes it); anything else is
    # not drawn, and the caption says so.
    shown_metrics = [m for m in panel.metrics if m in metrics]
    constants: list[dict[str, Any]] = []
    derived: list[tuple[dict[str, Any], _Series, float]] = []
    notes: list[str] = []  # rules on these metrics that are not constants of the plotted scale
    baselines = history.baselines.get(run, {})
    for metric in shown_metrics:
        drawn = [k for m, k, _ in chosen if m == metric]
        consts, other = _thresholds(rules, metric, drawn)
        constants.extend(consts)
        for rule, _only in other:
            if rule.transform != "ratio_to_median":
                notes.append(
                    f"{rule.alert} compares the {rule.transform} of {metric} between reports, not its value:"
                    " its threshold is not on this scale and is not drawn"
                )
                continue
            pos = next((i for i, r in enumerate(history.rules) if r == rule), -1)  # -1: kept without it
            watched = [(key, baselines[(pos, key)]) for m, key, _ in chosen if m == metric and (pos, key) in baselines]
            for key, base in watched:
                of = f" of {_label_text(metric, key)}" if len(drawn) > 1 else ""
                kind = "above" if rule.above is not None else "below"
                spec = {"alert": rule.alert, "severity": rule.severity}
                fires = f"{rule.alert} fires {kind}: {format_value(rule.threshold)} x median{of}"
                derived.append(({**spec, "kind": kind, "label": fires}, base, rule.threshold))
                if rule.clear is not None and rule.clear != rule.threshold:
                    clears = f"{rule.alert} clears at: {format_value(rule.clear)} x median{of}"
                    derived.append(({**spec, "kind": "clear", "label": clears}, base, rule.clear))
            if watched:
                notes.append(_ratio_note(rule, metric))
            else:
                why = (
                    f"fewer than {rule.history_needed + 1} reports of the series it watches"
                    if pos >= 0
                    else "the page was built without the rule's history"
                )
                notes.append(
                    f"{rule.alert} compares {metric} to {format_value(rule.threshold)} x its median over the previous "
                    f"{rule.window} reports; not drawn: {why}"
                )
    # One x axis: every bucket start of the chosen series, and a point just after it for
    # the bucket's max when the bucket holds more than one report.
    everything = [s for _, _, s in chosen] + [b for _, b, _ in derived]
    xs: set[float] = set()
    for s in everything:
        xs.update(s.steps)
        if s.per_bucket > 1:
            xs.update(x + 0.5 * s.per_bucket for x in s.steps)
    x = sorted(xs)
    index = {v: i for i, v in enumerate(x)}

    def column(s: _Series, factor: float = 1.0) -> list[float | None]:
        col: list[float | None] = [None] * len(x)
        for st, lo, hi in zip(s.steps, s.lo, s.hi, strict=True):
            if s.per_bucket > 1:
                col[index[st]] = _num(lo * factor)
                col[index[st + 0.5 * s.per_bucket]] = _num(hi * factor)
            else:
                col[index[st]] = _num(lo * factor)
        return col

    series = [
        {"label": _label_text(m, k), "metric": m, "incident": (m, k) in wanted_keys, "values": column(s)}
        for m, k, s in chosen
    ]
    for spec, base, factor in derived:
        series.append(
            {
                "label": spec["label"],
                "metric": None,
                "incident": False,
                "threshold": {"alert": spec["alert"], "severity": spec["severity"], "kind": spec["kind"]},
                "values": column(base, factor),
            }
        )
    return {
        "key": panel.key,
        "title": panel.title,
        "x": [_num(v) for v in x],
        "series": series,
        "thresholds": constants,
        "multi_metric": len(shown_metrics) > 1,
        "notes": notes,
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
        panels = [
            p for p in (_panel_data(panel, metrics, verdict, builder.rules, history, run) for panel in PANELS) if p
        ]
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
