"""The trainvitals Grafana dashboards, written with Grafana's foundation SDK.

    python dashboards/generate.py            # rewrite dashboards/*.json
    python dashboards/generate.py --check    # exit 1 if a committed file is stale

The JSON files next to this script are what Grafana loads (deploy/ provisions
this folder); they are generated, never edited by hand, and a test fails when
they differ from what this script writes. Needs ``pip install -e .[dev]``
(``grafana-foundation-sdk``, pinned in pyproject.toml).

Conventions:
- Every panel's unit comes from the metric catalogue (``trainvitals.wire.METRICS``,
  :data:`UNITS`) unless the query changes the unit (an age in seconds, a rate).
- Thresholds drawn on panels are the default alert rules' (``alerts/rules/``), so
  a dashboard line sits where the alert fires.
- Variables: ``datasource`` (any Prometheus), ``run`` on every dashboard, then
  ``modality``, ``param`` or ``task`` where the panels have that label. Each is
  a ``label_values()`` query narrowed by the runs selected.
- Metric names follow the catalogue: ``grad_norm``/``param_norm``/``update_ratio``
  and ``loss`` are whole-model, ``group_*`` per param group and ``modality_loss``
  per modality, so no panel sums a total with its parts.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from grafana_foundation_sdk.builders import bargauge, stat, table, timeseries
from grafana_foundation_sdk.builders.common import (
    GraphThresholdsStyleConfig,
    ReduceDataOptions,
    VizLegendOptions,
)
from grafana_foundation_sdk.builders.dashboard import (
    AnnotationQuery,
    Dashboard,
    DashboardLink,
    DatasourceVariable,
    QueryVariable,
    Row,
    ThresholdsConfig,
)
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    BigValueGraphMode,
    GraphThresholdsStyleMode,
    LegendDisplayMode,
    LegendPlacement,
    VizOrientation,
)
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DashboardLinkType,
    DataSourceRef,
    Threshold,
    ThresholdsMode,
    VariableOption,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from trainvitals.alerts import SilenceRule, ThresholdRule, load_rules
from trainvitals.wire import METRICS, PREFIX
from trainvitals.wire.signals import OVERVIEW_DASHBOARD, spec_of

HERE = Path(__file__).resolve().parent
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
TAG = "trainvitals"

# Grafana unit per catalogue unit. Grafana has no unit for log2 ranges, entropy
# or plain factors, so those get a custom suffix ("suffix:<text>" is Grafana's
# custom-unit syntax). "norm" and "value" are in the tensor's own unit: none.
UNITS = {
    "ratio": "percentunit",
    "x": "suffix:x",
    "seconds": "s",
    "nats": "suffix: nats",
    "bits": "suffix: bits",
    "count": "short",
    "step": "none",
    "norm": "none",
    "value": "none",
}
RATE_UNIT = "cps"  # counts per second, for rate() of a counter

# Metrics the dashboards show on purpose nowhere, with why. Every other metric of
# the catalogue that no curated panel shows gets a generated one in a last row of
# its group's dashboard (boards()), until someone curates it.
NOT_ON_DASHBOARDS: dict[str, str] = {}


def unit_of(metric: str) -> str:
    """The Grafana unit of a catalogue metric (wire name)."""
    try:
        spec = METRICS[metric]
    except KeyError:
        raise ValueError(f"{metric!r} is not in trainvitals.wire.METRICS") from None
    try:
        return UNITS[spec.unit]
    except KeyError:
        raise ValueError(
            f"metric {metric!r}: no Grafana unit for catalogue unit {spec.unit!r}; add it to UNITS"
        ) from None


def m(metric: str, *matchers: str) -> str:
    """A selector of a catalogue metric: ``m("loss", 'run=~"$run"')``."""
    if metric not in METRICS:
        raise ValueError(f"{metric!r} is not in trainvitals.wire.METRICS")
    return f"{PREFIX}{metric}{{{', '.join(matchers)}}}" if matchers else f"{PREFIX}{metric}"


def lg(metric: str, suffix: str = "") -> str:
    """The legend of a catalogue metric's series: its run and every label the
    catalogue gives it (so a label added there shows up here), then ``suffix``."""
    if metric not in METRICS:
        raise ValueError(f"{metric!r} is not in trainvitals.wire.METRICS")
    return "{{run}}" + "".join(f" {{{{{label}}}}}" for label in METRICS[metric].labels) + suffix


RUN = 'run=~"$run"'
MODALITY = 'modality=~"$modality"'
PARAM = 'param=~"$param"'
TASK = 'task=~"$task"'


# -- thresholds from the default rules ------------------------------------------------
# An alert split into severity variants (LossNotAccumNormalized) draws its first, most severe one.
_RULES = {r.alert: r for r in reversed(load_rules(["default"]))}
_SEVERITY_COLORS = {"page": "red", "warning": "orange", "info": "blue"}


def rule_line(alertname: str) -> tuple[float, str, bool]:
    """(threshold, color, fires above) of a default rule, for a line on its panel.
    RunSilent's line is its silence in seconds."""
    rule = _RULES.get(alertname)
    if rule is None:
        raise ValueError(f"{alertname!r} is not a default rule")
    color = _SEVERITY_COLORS.get(rule.severity, "red")
    if isinstance(rule, ThresholdRule):
        return rule.threshold, color, rule.above is not None
    if isinstance(rule, SilenceRule):
        return rule.silent_for, color, True
    raise ValueError(f"{alertname!r} has no threshold to draw")


# -- panels ---------------------------------------------------------------------------------
@dataclass
class P:
    """One panel: what it shows, how, and where its unit comes from.

    ``metric``: the catalogue metric the values are in (its unit is the panel's);
    ``unit``: given instead when the query changes the unit. ``queries``: (PromQL,
    legend) pairs. ``lines``: alert names whose thresholds are drawn.
    """

    title: str
    queries: list[tuple[str, str]]
    description: str
    metric: str | None = None
    unit: str | None = None
    kind: str = "timeseries"  # timeseries | stat | bargauge | table
    lines: list[str] = field(default_factory=list)
    width: int = 8
    height: int = 8
    min: float | None = None
    max: float | None = None

    def grafana_unit(self) -> str:
        if self.unit is not None:
            return self.unit
        if self.metric is None:
            raise ValueError(f"panel {self.title!r}: give metric= or unit=")
        return unit_of(self.metric)


def _thresholds(p: P) -> ThresholdsConfig:
    # Grafana colors a value by the highest step at or below it: an "above" rule
    # turns its color at the threshold; a "below" rule colors everything under
    # its threshold and hands back to green there.
    base, steps = "green", []
    for value, color, above in (rule_line(a) for a in p.lines):
        if above:
            steps.append(Threshold(value=value, color=color))
        else:
            base = color
            steps.append(Threshold(value=value, color="green"))
    steps.sort(key=lambda t: t.value)
    return ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps([Threshold(value=None, color=base), *steps])


def _targets(p: P, instant: bool) -> list[Dataquery]:
    out = []
    for i, (expr, legend) in enumerate(p.queries):
        q = Dataquery().expr(expr).legend_format(legend).ref_id(chr(ord("A") + i))
        if instant:
            q = q.instant()
            if p.kind == "table":
                q = q.format(PromQueryFormat.TABLE)
        else:
            q = q.range()
        out.append(q)
    return out


def describe(p: P) -> str:
    """The panel's description: the metric's one definition, from the catalogue (what
    /metrics' HELP and docs/metrics.md say too), then what the panel adds."""
    if p.metric is None:
        return p.description
    definition = f"{PREFIX}{p.metric}: {METRICS[p.metric].help}"
    if p.description == METRICS[p.metric].help:
        return definition
    return f"{definition}\n\n{p.description}"


def build_panel(p: P, panel_id: int):
    instant = p.kind in ("stat", "bargauge", "table")
    if p.kind == "timeseries":
        b = (
            timeseries.Panel()
            .legend(
                VizLegendOptions()
                .display_mode(LegendDisplayMode.TABLE)
                .placement(LegendPlacement.BOTTOM)
                .show_legend(True)
                .calcs(["lastNotNull", "max"])
            )
            .line_width(1)
            .fill_opacity(5)
            .show_points("never")
        )
        if p.lines:
            b = b.thresholds_style(GraphThresholdsStyleConfig().mode(GraphThresholdsStyleMode.DASHED))
    elif p.kind == "stat":
        b = (
            stat.Panel()
            .graph_mode(BigValueGraphMode.NONE)
            .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        )
    elif p.kind == "bargauge":
        b = (
            bargauge.Panel()
            .orientation(VizOrientation.HORIZONTAL)
            .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        )
    elif p.kind == "table":
        b = table.Panel()
    else:
        raise ValueError(f"panel {p.title!r}: unknown kind {p.kind!r}")
    b = (
        b.id(panel_id)
        .title(p.title)
        .description(describe(p))
        .datasource(DATASOURCE)
        .unit(p.grafana_unit())
        .thresholds(_thresholds(p))
        .span(p.width)
        .height(p.height)
    )
    if p.min is not None:
        b = b.min(p.min)
    if p.max is not None:
        b = b.max(p.max)
    for t in _targets(p, instant):
        b = b.with_target(t)
    return b


def _variable(name: str, label: str, metric: str, label_name: str, *, narrow: bool = True) -> QueryVariable:
    selector = m(metric, RUN) if narrow else m(metric)
    return (
        QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(f"label_values({selector}, {label_name})")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        # ".+", not ".*": "All" must not match series that lack the label (Adam's
        # per-group series have no param; collector series no run).
        .all_value(".+")
        .current(VariableOption(selected=True, text=["All"], value=["$__all"]))
    )


VARIABLES = {
    "run": _variable("run", "Run", "step", "run", narrow=False),
    "modality": _variable("modality", "Modality", "modality_sample_share_ratio", "modality"),
    "param": _variable("param", "1D parameter", "param_drift_log2", "param"),
    "task": _variable("task", "Task", "softmax_top1_prob_mean", "task"),
}


@dataclass
class Board:
    """One dashboard before it is built: its curated rows, then (``auto``) a panel
    for each catalogue metric no curated panel shows (:func:`render` adds them)."""

    uid: str
    title: str
    description: str
    variables: list[str]
    rows: list[tuple[str, list[P]]]
    auto: list[P] = field(default_factory=list)

    def build(self) -> Dashboard:
        d = (
            Dashboard(self.title)
            .uid(self.uid)
            .description(self.description)
            .tags([TAG])
            .editable()
            .tooltip(DashboardCursorSync.CROSSHAIR)
            .time("now-6h", "now")
            .refresh("30s")
            .timezone("browser")
            .annotation(
                AnnotationQuery()
                .name("Annotations & Alerts")
                .built_in(1)
                .enable(True)
                .hide(True)
                .icon_color("rgba(0, 211, 255, 1)")
                .type("dashboard")
                .datasource(DataSourceRef(type_val="grafana", uid="-- Grafana --"))
            )
            .link(
                DashboardLink("trainvitals")
                .type(DashboardLinkType.DASHBOARDS)
                .tags([TAG])
                .as_dropdown(True)
                .include_vars(True)
                .keep_time(True)
            )
            .with_variable(DatasourceVariable("datasource").label("Data source").type("prometheus"))
        )
        for name in ["run", *self.variables]:
            d = d.with_variable(VARIABLES[name])
        rows = list(self.rows)
        if self.auto:
            rows.append((AUTO_ROW, self.auto))
        panel_id = 1
        for row_title, panels in rows:
            d = d.with_row(Row(row_title).id(panel_id))
            panel_id += 1
            for p in panels:
                d = d.with_panel(build_panel(p, panel_id))
                panel_id += 1
        return d


def build_dashboard(
    uid: str, title: str, description: str, variables: list[str], rows: list[tuple[str, list[P]]]
) -> Board:
    return Board(uid, title, description, variables, rows)


# -- metrics no curated panel shows ----------------------------------------------------------
AUTO_ROW = "More signals (one panel per metric, generated from the catalogue)"


def group_home(group: str) -> str:
    """The dashboard a catalogue group belongs on: its signal's spec says
    (:class:`~trainvitals.wire.signals.SignalSpec`'s ``dashboard``); other groups go on
    the overview."""
    spec = spec_of(group)
    return spec.dashboard if spec is not None and spec.group == group else OVERVIEW_DASHBOARD


# A dashboard variable narrows the metrics that carry its label.
VARIABLE_MATCHERS = {"modality": MODALITY, "param": PARAM, "task": TASK}
_SHOWN = re.compile(rf"\b{PREFIX}(\w+)")


def auto_panel(metric: str, board: Board) -> P:
    """A plain time series of a catalogue metric, narrowed by the board's variables."""
    spec = METRICS[metric]
    matchers = [RUN] if spec.owner == "hooks" or spec.group == "run" else []
    matchers += [VARIABLE_MATCHERS[v] for v in board.variables if v in spec.labels]
    return P(
        metric,
        [
            (
                m(metric, *matchers),
                lg(metric)
                if matchers[:1] == [RUN]
                else " ".join(f"{{{{{label}}}}}" for label in spec.labels) or metric,
            )
        ],
        spec.help,
        metric=metric,
    )


# -- the dashboards ------------------------------------------------------------------------------
# The whole-model gradient norm of the last step, and the per-step statistics over
# the steps since the previous report (grad_norm_max, ...) that the catalogue has.
GRAD_NORMS = [("grad_norm", "last step")] + [
    (n, n.removeprefix("grad_norm_")) for n in METRICS if n.startswith("grad_norm_")
]


def overview() -> Board:
    age = f"time() - {m('last_report_timestamp_seconds', RUN)}"
    silent = rule_line("RunSilent")[0]
    rows = [
        (
            "Runs",
            [
                P(
                    "Runs",
                    [(f"count({m('step', RUN)})", "runs")],
                    "Runs the collectors hold (they forget a run silent for run_ttl_seconds).",
                    unit="short",
                    kind="stat",
                    width=4,
                    height=5,
                ),
                P(
                    "Ended cleanly",
                    [(f"count({m('run_ended', RUN)} == 1)", "ended")],
                    "Runs whose last report said they ended (Monitor.close()): RunSilent spares them.",
                    metric="run_ended",
                    kind="stat",
                    width=4,
                    height=5,
                ),
                P(
                    "Alerts firing (collector)",
                    [(f"sum({m('alerts_firing', RUN)})", "firing")],
                    "Alerts the collectors' own rule engines have firing now, for the runs selected.",
                    metric="alerts_firing",
                    kind="stat",
                    width=4,
                    height=5,
                ),
                P(
                    "Last step",
                    [(m("step", RUN), lg("step"))],
                    "Last optimizer step each run reported.",
                    metric="step",
                    kind="bargauge",
                    width=6,
                    height=5,
                ),
                P(
                    "Signals watching",
                    [(m("signal_active", RUN), "{{run}} {{signal}}: {{reason}}")],
                    "Each signal of each run: 1 watching, 0 not (with the reason); SignalInactive warns "
                    "under the line for a reason other than not requested or not applicable.",
                    metric="signal_active",
                    lines=["SignalInactive"],
                    kind="table",
                    width=6,
                    height=5,
                ),
                P(
                    "Last report age",
                    [(age, "{{run}}")],
                    f"Seconds since each run's last report reached a collector. RunSilent fires "
                    f"at {silent:g} s (the line); a run that ended with Monitor.close() stops here.",
                    unit="s",
                    kind="bargauge",
                    lines=["RunSilent"],
                    width=6,
                    height=5,
                ),
            ],
        ),
        (
            "Alerts",
            [
                P(
                    "Firing now (collector rules)",
                    [(m("alerts_firing", RUN), "{{run}} {{alertname}} ({{severity}})")],
                    "Alerts the collectors evaluate, by run, rule and severity: how many series fire "
                    "(0 for each rule of a run that is watched and quiet).",
                    metric="alerts_firing",
                    width=12,
                ),
                P(
                    "Firing now (Prometheus rules)",
                    [
                        (
                            f'count by (alertname, severity) (ALERTS{{alertstate="firing", {RUN}}})',
                            "{{alertname}} ({{severity}})",
                        )
                    ],
                    "The same rules exported to Prometheus (`trainvitals rules export`), where "
                    "Prometheus evaluates them: series firing per rule.",
                    unit="short",
                    width=12,
                ),
            ],
        ),
        (
            "Training",
            [
                P(
                    "Loss",
                    [(m("loss", RUN), lg("loss"))],
                    "Mean per-token loss of the last optimizer step over every label token "
                    "(per modality: the loss accounting dashboard).",
                    metric="loss",
                ),
                P(
                    "Gradient norm",
                    [(m(n, RUN), f"{{{{run}}}} {label}") for n, label in GRAD_NORMS],
                    "Whole model. "
                    + " ".join(f"{label}: {METRICS[n].help}" for n, label in GRAD_NORMS)
                    + " GradNormSpike compares the norm with its own recent median.",
                    metric="grad_norm",
                ),
                P(
                    "Update ratio",
                    [(m("update_ratio", RUN), lg("update_ratio"))],
                    "RMS(update) / RMS(parameter) of the last step, whole model; ~1e-3 is typical for Adam.",
                    metric="update_ratio",
                ),
                P(
                    "Parameter norm",
                    [(m("param_norm", RUN), lg("param_norm"))],
                    "Whole-model parameter L2 norm after the optimizer step.",
                    metric="param_norm",
                ),
                P(
                    "Non-finite values",
                    [(f"increase({m('nonfinite_total', RUN)}[$__rate_interval])", "{{run}} {{what}}")],
                    "Non-finite losses (what=loss: NonFiniteLoss pages) and gradients (what=grad: "
                    "routine under fp16 loss scaling) in each interval.",
                    metric="nonfinite_total",
                ),
                P(
                    "Reports dropped by the hooks",
                    [(m("client_dropped_reports_total", RUN), lg("client_dropped_reports_total"))],
                    "Reports a job dropped since attach (queue full or collector unreachable): the "
                    "dashboards miss those steps.",
                    metric="client_dropped_reports_total",
                ),
            ],
        ),
        (
            "Collectors",
            [
                P(
                    "Reports",
                    [
                        (
                            f"sum by (instance, outcome) (rate({m('collector_reports_total')}[$__rate_interval]))",
                            "{{instance}} {{outcome}}",
                        )
                    ],
                    "Reports accepted and bodies refused per second, by collector and outcome.",
                    unit=RATE_UNIT,
                ),
                P(
                    "Series held",
                    [(m("collector_series"), "{{instance}}")],
                    "Series each collector holds; it refuses batches past max_series.",
                    metric="collector_series",
                ),
                P(
                    "Notifications",
                    [
                        (
                            f"sum by (instance, notifier, outcome) (rate("
                            f"{m('notifications_total')}[$__rate_interval]))",
                            "{{notifier}} {{outcome}}",
                        ),
                        (
                            f"sum by (instance, notifier) (rate({m('notification_retries_total')}[$__rate_interval]))",
                            "{{notifier}} retries",
                        ),
                    ],
                    "Alert notifications the collectors sent, failed or dropped, and retried sends, per second.",
                    unit=RATE_UNIT,
                ),
                P(
                    "Notifications queued",
                    [(m("notifications_queued"), "{{instance}} {{notifier}}")],
                    "Notifications waiting in each notifier's queue (a growing queue: the receiver is slow or down).",
                    metric="notifications_queued",
                ),
            ],
        ),
        (
            "Packed sequences: samples leaking into each other",
            [
                P(
                    "Boundary leak (probe)",
                    [(m("packing_leak_logit_change", RUN), "{{run}} {{cause}}")],
                    "Largest change of a packed row's later samples' logits when its first sample's tokens "
                    "change (0 with a proper mask); PackedSamplesLeak pages past the line.",
                    metric="packing_leak_logit_change",
                    lines=["PackedSamplesLeak"],
                    min=0,
                ),
                P(
                    "Leak signs",
                    [(m("packing_leak_sign", RUN), "{{run}} {{cause}}")],
                    "1 on report steps whose packed micro-batch reaches the model in a way its attention "
                    "ignores the sample boundaries of (the cause names which).",
                    metric="packing_leak_sign",
                    min=0,
                    max=1,
                ),
                P(
                    "Samples per packed row",
                    [(m("packing_samples_per_row", RUN), "{{run}}")],
                    "Mean number of samples in one row of the checked micro-batch (where rows hold several).",
                    metric="packing_samples_per_row",
                    min=0,
                ),
            ],
        ),
    ]
    return build_dashboard(
        "trainvitals-overview",
        "trainvitals / Overview",
        "Runs, their last report, alerts firing and the whole-model training curves.",
        [],
        rows,
    )


def loss_accounting() -> Board:
    mod = (RUN, MODALITY)
    rows = [
        (
            "Where the gradient goes (I1)",
            [
                P(
                    "Sample vs gradient share",
                    [
                        (m("modality_sample_share_ratio", *mod), lg("modality_sample_share_ratio", " samples")),
                        (m("modality_grad_share_ratio", *mod), lg("modality_grad_share_ratio", " gradient")),
                    ],
                    "Each modality's share of the step's samples against its share of the loss "
                    "weight sum(dL/dl). Per-sample normalization keeps them equal.",
                    metric="modality_sample_share_ratio",
                    width=12,
                    min=0,
                    max=1,
                ),
                P(
                    "Dilution against the intended normalization",
                    [(m("modality_excess_dilution_ratio", *mod), lg("modality_excess_dilution_ratio"))],
                    "What GradientDilution pages on, past the line: how many times less gradient a "
                    "modality gets than the loss normalization the job intends gives it (1: as intended).",
                    metric="modality_excess_dilution_ratio",
                    lines=["GradientDilution"],
                    width=12,
                ),
                P(
                    "Dilution against the sample share",
                    [(m("modality_dilution_ratio", *mod), lg("modality_dilution_ratio"))],
                    "How many times less gradient a modality gets than its samples' share (1: none), "
                    "deliberate or not; past the line with the intended normalization's blessing it is "
                    "the info note LossNormalizationDilutes.",
                    metric="modality_dilution_ratio",
                    lines=["LossNormalizationDilutes"],
                    width=12,
                ),
                P(
                    "Token share",
                    [(m("modality_token_share_ratio", *mod), lg("modality_token_share_ratio"))],
                    "Each modality's share of the step's label tokens.",
                    metric="modality_token_share_ratio",
                    min=0,
                    max=1,
                ),
                P(
                    "Loss per modality",
                    [(m("modality_loss", *mod), lg("modality_loss"))],
                    "Mean per-token loss over each modality's label tokens.",
                    metric="modality_loss",
                ),
                P(
                    "Gradient norm per modality",
                    [(m("modality_grad_norm", *mod), lg("modality_grad_norm"))],
                    "Per-modality gradient norm at the output (scope=output) and, on probe steps, "
                    "in parameter space (scope=params).",
                    metric="modality_grad_norm",
                ),
                P(
                    "Gradient cosine between modalities",
                    [(m("modality_grad_cosine", *mod), "{{run}} {{modality}} / {{other}}")],
                    "Cosine between two modalities' parameter gradients (probe steps; "
                    "attach(probe_every=N)). Negative: they pull the model apart.",
                    metric="modality_grad_cosine",
                    min=-1,
                    max=1,
                ),
            ],
        ),
        (
            "Normalization (I2, I3)",
            [
                P(
                    "Normalization exponent",
                    [(m("loss_norm_exponent", RUN), lg("loss_norm_exponent"))],
                    "Fitted beta in w ~ n^beta over the step's samples: 1 per-token, 0.5 sqrt, "
                    "0 per-sample normalization.",
                    metric="loss_norm_exponent",
                ),
                P(
                    "Loss weight mass",
                    [(m("loss_weight_mass", RUN), lg("loss_weight_mass"))],
                    "Sum of the step's loss weights: 1 when normalized; N when the loss is not "
                    "divided by N accumulation steps (LossNotAccumNormalized, upper line); under "
                    "the lower line it is divided twice or averaged over non-label tokens "
                    "(LossWeightMassLow).",
                    metric="loss_weight_mass",
                    lines=["LossNotAccumNormalized", "LossWeightMassLow"],
                ),
                P(
                    "Accumulation exponent",
                    [(m("loss_accumulation_exponent", RUN), lg("loss_accumulation_exponent"))],
                    "How the mass scales with the micro-batch count: near 1 with a mass past the upper "
                    "line, LossNotAccumNormalized fires; near -1 under the lower line, LossWeightMassLow.",
                    metric="loss_accumulation_exponent",
                ),
                P(
                    "Optimizer family",
                    [(m("optimizer_scale_invariant", RUN), lg("optimizer_scale_invariant"))],
                    "Decides what a missing division does and so LossNotAccumNormalized's severity: "
                    "1 (Adam-like) warns, 0 (SGD-like) or 0.5 (unknown) pages.",
                    metric="optimizer_scale_invariant",
                    kind="stat",
                    min=0,
                    max=1,
                ),
                P(
                    "Micro-batches per step",
                    [(m("microbatches", RUN), lg("microbatches"))],
                    "track_loss calls in the last optimizer step.",
                    metric="microbatches",
                ),
                P(
                    "Token weight spread",
                    [(m("token_weight_spread_ratio", RUN), lg("token_weight_spread_ratio"))],
                    "Max/min per-token weight across the step's micro-batches: 1 for a global "
                    "per-token normalization; above the line, a mean of means (MeanOfMeansLoss). A series "
                    'labelled normalization="sample" is a declared per-sample intent: not judged.',
                    metric="token_weight_spread_ratio",
                    lines=["MeanOfMeansLoss"],
                ),
            ],
        ),
    ]
    return build_dashboard(
        "trainvitals-loss",
        "trainvitals / Loss accounting",
        "Where each step's gradient weight goes: per modality (I1), over the step (I2) and across micro-batches (I3).",
        ["modality"],
        rows,
    )


def parameter_drift() -> Board:
    sel = (RUN, PARAM)
    drift = m("param_drift_log2", *sel)
    rows = [
        (
            "Drift of 1D parameters (I4)",
            [
                P(
                    "Top drifting 1D parameters",
                    [(f"topk(10, {drift})", "{{run}} {{param}}")],
                    "Largest ten. ParamDrift pages past the line when the drift is one-way, "
                    "gradient-free and undecayed.",
                    metric="param_drift_log2",
                    lines=["ParamDrift"],
                    kind="bargauge",
                    width=12,
                ),
                P(
                    "Drift over time",
                    [(f"topk(10, {drift})", "{{run}} {{param}}")],
                    "The same drift over time, largest ten at each point.",
                    metric="param_drift_log2",
                    lines=["ParamDrift"],
                    width=12,
                ),
                P(
                    "Drift consistency",
                    [(m("param_drift_consistency_ratio", *sel), lg("param_drift_consistency_ratio"))],
                    "|mean sign| of each parameter's recent changes: 0 for a random walk, 1 when it "
                    "only moves one way.",
                    metric="param_drift_consistency_ratio",
                    min=0,
                    max=1,
                ),
                P(
                    "Drift of parameters without weight decay",
                    [(f"{drift} and {m('param_weight_decay', *sel)} == 0", "{{run}} {{param}}")],
                    "Only the 1D parameters the optimizer applies no weight decay to: nothing "
                    "pulls them back when Adam walks them.",
                    metric="param_drift_log2",
                    lines=["ParamDrift"],
                ),
                P(
                    "Weight decay per parameter",
                    [(m("param_weight_decay", *sel), lg("param_weight_decay"))],
                    "Weight decay the optimizer applies to each 1D parameter (0: none).",
                    metric="param_weight_decay",
                    kind="table",
                ),
                P(
                    "Relative gradient RMS",
                    [(m("param_grad_relative_rms", *sel), lg("param_grad_relative_rms"))],
                    "Gradient RMS over the model's median per-parameter gradient RMS: far below "
                    "0.01, the parameter has no real gradient.",
                    metric="param_grad_relative_rms",
                ),
                P(
                    "Largest absolute element",
                    [(m("param_absmax", *sel), lg("param_absmax"))],
                    "absmax of each 1D parameter.",
                    metric="param_absmax",
                ),
                P(
                    "Range",
                    [(m("param_min", *sel), lg("param_min", " min")), (m("param_max", *sel), lg("param_max", " max"))],
                    "Smallest and largest element of each 1D parameter.",
                    metric="param_min",
                ),
            ],
        ),
        (
            "Adam state (I4)",
            [
                P(
                    "Eps-dominated share",
                    [(m("adam_eps_dominated_ratio", *sel), "{{run}} {{param}}")],
                    "Share of a parameter's elements with sqrt(v_hat) < eps: Adam divides by eps "
                    "and amplifies noise into full-size steps (AdamEpsilonDominated).",
                    metric="adam_eps_dominated_ratio",
                    lines=["AdamEpsilonDominated"],
                    min=0,
                    max=1,
                ),
                P(
                    "Normalized update RMS",
                    [(m("adam_normalized_update_rms", *sel), "{{run}} {{param}}")],
                    "RMS of m_hat / (sqrt(v_hat) + eps): near 1, sign-like steps of size lr.",
                    metric="adam_normalized_update_rms",
                ),
                P(
                    "First moment norm",
                    [(m("adam_exp_avg_norm", *sel), "{{run}} {{param}}")],
                    "L2 norm of Adam's exp_avg per parameter.",
                    metric="adam_exp_avg_norm",
                ),
                P(
                    "Second moment norm",
                    [(m("adam_exp_avg_sq_norm", *sel), "{{run}} {{param}}")],
                    "L2 norm of Adam's exp_avg_sq per parameter.",
                    metric="adam_exp_avg_sq_norm",
                ),
                P(
                    "Optimizer state resets",
                    [(m("optimizer_state_resets_total", RUN), lg("optimizer_state_resets_total"))],
                    "Optimizer state resets seen since attach: each restarts the period where v is "
                    "near zero (OptimizerStateReset).",
                    metric="optimizer_state_resets_total",
                ),
            ],
        ),
        (
            "Param groups",
            [
                P(
                    "Gradient norm per group",
                    [(m("group_grad_norm", RUN), lg("group_grad_norm"))],
                    "Gradient L2 norm of each optimizer param group.",
                    metric="group_grad_norm",
                ),
                P(
                    "Parameter norm per group",
                    [(m("group_param_norm", RUN), lg("group_param_norm"))],
                    "Parameter L2 norm of each param group after the step.",
                    metric="group_param_norm",
                ),
                P(
                    "Update ratio per group",
                    [(m("group_update_ratio", RUN), lg("group_update_ratio"))],
                    "RMS(update) / RMS(parameter) of each param group.",
                    metric="group_update_ratio",
                ),
            ],
        ),
    ]
    return build_dashboard(
        "trainvitals-params",
        "trainvitals / Parameter drift",
        "1D parameters Adam walks without a gradient (I4), the Adam state behind it, and the param groups.",
        ["param"],
        rows,
    )


def softmax() -> Board:
    sel = (RUN, TASK)
    by = "{{run}} {{task}} {{role}}"
    rows = [
        (
            "Saturation per task and role (I5)",
            [
                P(
                    "Mean top-1 probability",
                    [(m("softmax_top1_prob_mean", *sel), by)],
                    "Mean top-1 softmax probability of each task's student and teacher.",
                    metric="softmax_top1_prob_mean",
                    min=0,
                    max=1,
                ),
                P(
                    "Saturated positions",
                    [(m("softmax_saturated_ratio", *sel), by + " > {{threshold}}")],
                    "Share of positions whose top-1 probability is above the threshold; "
                    "SoftmaxSaturation warns past the line (threshold 0.99).",
                    metric="softmax_saturated_ratio",
                    lines=["SoftmaxSaturation"],
                    min=0,
                    max=1,
                ),
                P(
                    "Jacobian q(1-q)",
                    [(m("softmax_jacobian_mean", *sel), by)],
                    "Mean q(1-q) of the top-1 probability: the gradient's scale through the top "
                    "class (0.25 at q = 0.5).",
                    metric="softmax_jacobian_mean",
                ),
                P(
                    "Entropy",
                    [(m("softmax_entropy_nats", *sel), by)],
                    "Mean softmax entropy.",
                    metric="softmax_entropy_nats",
                ),
                P(
                    "Recommended temperature",
                    [(m("softmax_recommended_temperature", *sel), by)],
                    "Temperature that brings the mean top-1 to the target (1: none needed).",
                    metric="softmax_recommended_temperature",
                ),
            ],
        ),
        (
            "Distillation",
            [
                P(
                    "KL gradient at the teacher's top-1",
                    [(m("distill_top1_grad_share_ratio", *sel), lg("distill_top1_grad_share_ratio"))],
                    "Share of the KL gradient on the student's logits at the teacher's top-1 class.",
                    metric="distill_top1_grad_share_ratio",
                    width=12,
                    min=0,
                    max=1,
                ),
                P(
                    "Dark knowledge",
                    [(m("distill_dark_knowledge_mass", *sel), lg("distill_dark_knowledge_mass"))],
                    "Mean teacher probability outside its top-1: what distillation can teach beyond the label.",
                    metric="distill_dark_knowledge_mass",
                    width=12,
                    min=0,
                    max=1,
                ),
            ],
        ),
    ]
    return build_dashboard(
        "trainvitals-softmax",
        "trainvitals / Softmax",
        "Softmax saturation per task and role, and what distillation transfers (I5).",
        ["task"],
        rows,
    )


DASHBOARDS = {
    "trainvitals-overview.json": overview,
    "trainvitals-loss.json": loss_accounting,
    "trainvitals-params.json": parameter_drift,
    "trainvitals-softmax.json": softmax,
}


def boards() -> dict[str, Board]:
    """File name -> every dashboard, with a panel added for each catalogue metric
    that no curated panel shows (on the dashboard of its catalogue group)."""
    out = {name: make() for name, make in DASHBOARDS.items()}
    shown = {
        name
        for b in out.values()
        for _, panels in b.rows
        for p in panels
        for expr, _ in p.queries
        for name in _SHOWN.findall(expr)
    }
    for metric, spec in METRICS.items():
        if metric not in shown and metric not in NOT_ON_DASHBOARDS:
            board = out[group_home(spec.group)]
            board.auto.append(auto_panel(metric, board))
    return out


def render() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    out = {}
    for name, board in boards().items():
        text = JSONEncoder(sort_keys=True, indent=2).encode(board.build().build())
        out[name] = json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if a committed file is stale")
    parser.add_argument("--out", type=Path, default=HERE, help="folder for the JSON files")
    args = parser.parse_args(argv)
    stale = []
    if not args.check:
        args.out.mkdir(parents=True, exist_ok=True)
    for name, text in render().items():
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            path.write_text(text, encoding="utf-8")
    if stale:
        print(f"stale: {', '.join(stale)}; run `python dashboards/generate.py`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
