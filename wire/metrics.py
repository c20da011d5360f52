"""The metric catalogue: one spec per metric, the single source of its name, type,
help, unit and labels.

Everything else is derived from :data:`METRICS`: the collector's HELP/TYPE lines,
the names a sample may not claim (:data:`RESERVED_NAMES`), the labels the rule
checker knows per metric (:func:`labels_of`), the Grafana panel units and the
metric reference in ``docs/metrics.md`` (:func:`reference_markdown`, checked
current by a test).

Names are wire names: the Prometheus name without the ``trainvitals_`` prefix.
Series of a run carry ``run`` (and ``rank`` on ranks other than 0, see
:func:`trainvitals.wire.series.series_labels`) besides the labels listed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "METRICS",
    "PREFIX",
    "RESERVED_NAMES",
    "MetricSpec",
    "exposed_family",
    "exposed_name",
    "labels_of",
    "metric_type",
]

PREFIX = "trainvitals_"

MetricType = Literal["gauge", "counter"]
Owner = Literal["hooks", "collector"]


@dataclass(frozen=True)
class MetricSpec:
    """One metric of the contract."""

    name: str
    """Wire name (no prefix). Counters end in ``_total``."""
    type: MetricType
    help: str
    """One line; the HELP text on ``/metrics``."""
    unit: str
    """``ratio`` (0..1), ``x`` (a factor), ``seconds``, ``nats``, ``bits``, ``count``,
    ``step``, ``norm`` (an L2 norm in the tensor's unit) or ``value`` (the tensor's own unit)."""
    labels: tuple[str, ...] = ()
    """Labels besides ``run``/``rank`` on a run's series (the collector's own metrics that
    are not per run, group ``collector``, list all their labels). The
    ``adam_*`` metrics carry ``param`` on a parameter's own series and ``group`` on the
    series of its param group's other parameters (parts, never a total)."""
    owner: Owner = "hooks"
    """Who produces it: the training-side hooks, or the collector itself."""
    group: str = ""
    """Where it is documented (a section of the metric reference)."""


def _m(
    name: str, type_: MetricType, unit: str, labels: tuple[str, ...], group: str, help_: str, owner: Owner = "hooks"
) -> MetricSpec:
    return MetricSpec(name, type_, help_, unit, labels, owner, group)


_SPECS: tuple[MetricSpec, ...] = (
    # -- per run, set by the collector from the reports themselves
    _m("step", "gauge", "step", (), "run", "Last reported optimizer step.", "collector"),
    _m(
        "last_report_timestamp_seconds",
        "gauge",
        "seconds",
        (),
        "run",
        "Unix time when the run's last report arrived.",
        "collector",
    ),
    _m(
        "run_ended",
        "gauge",
        "count",
        (),
        "run",
        "1 when the run's last report said it ended (Monitor.close()); absent otherwise.",
        "collector",
    ),
    _m(
        "signal_active",
        "gauge",
        "count",
        ("signal", "reason"),
        "run",
        "1 while a built-in signal produces figures; 0 with the reason why not (from the reports' coverage).",
        "collector",
    ),
    # -- optimizer step (table stakes)
    _m(
        "grad_norm",
        "gauge",
        "norm",
        (),
        "optimizer",
        "Global gradient L2 norm before clipping, at the end of the last step's backward.",
    ),
    _m(
        "grad_norm_max",
        "gauge",
        "norm",
        (),
        "optimizer",
        "Largest global gradient norm (before clipping) of the steps since the previous report.",
    ),
    _m(
        "grad_norm_mean",
        "gauge",
        "norm",
        (),
        "optimizer",
        "Mean global gradient norm (before clipping) of the steps since the previous report.",
    ),
    _m(
        "group_grad_norm",
        "gauge",
        "norm",
        ("group",),
        "optimizer",
        "Gradient L2 norm of one param group, before clipping (as grad_norm).",
    ),
    _m("param_norm", "gauge", "norm", (), "optimizer", "Global parameter L2 norm after the optimizer step."),
    _m(
        "group_param_norm",
        "gauge",
        "norm",
        ("group",),
        "optimizer",
        "Parameter L2 norm of one param group after the optimizer step.",
    ),
    _m(
        "update_ratio",
        "gauge",
        "x",
        (),
        "optimizer",
        "RMS(update) / RMS(parameter) of the last optimizer step, whole model.",
    ),
    _m(
        "group_update_ratio",
        "gauge",
        "x",
        ("group",),
        "optimizer",
        "RMS(update) / RMS(parameter) of the last optimizer step, one param group.",
    ),
    _m(
        "nonfinite_total",
        "counter",
        "count",
        ("what",),
        "optimizer",
        "Micro-batches with a non-finite loss (what=loss), steps with a non-finite gradient (what=grad).",
    ),
    # -- loss accounting (I1-I3)
    _m("loss", "gauge", "value", (), "loss", "Mean per-token loss of the last optimizer step."),
    _m(
        "modality_loss",
        "gauge",
        "value",
        ("modality",),
        "loss",
        "Mean per-token loss of the last optimizer step over one modality's label tokens.",
    ),
    _m(
        "modality_sample_share_ratio",
        "gauge",
        "ratio",
        ("modality",),
        "loss",
        "Share of the step's samples per modality.",
    ),
    _m(
        "modality_token_share_ratio",
        "gauge",
        "ratio",
        ("modality",),
        "loss",
        "Share of the step's label tokens per modality.",
    ),
    _m(
        "modality_grad_share_ratio",
        "gauge",
        "ratio",
        ("modality",),
        "loss",
        "Share of the step's loss weight sum(dL/dl) per modality.",
    ),
    _m(
        "modality_dilution_ratio",
        "gauge",
        "x",
        ("modality",),
        "loss",
        "Sample share over gradient-weight share per modality (I1).",
    ),
    _m(
        "modality_excess_dilution_ratio",
        "gauge",
        "x",
        ("modality",),
        "loss",
        "Gradient-weight share the intended normalization gives the modality over the share it gets.",
    ),
    _m(
        "modality_grad_norm",
        "gauge",
        "norm",
        ("modality", "scope"),
        "loss",
        "Per-modality gradient norm (scope=output|params).",
    ),
    _m(
        "modality_grad_cosine",
        "gauge",
        "value",
        ("modality", "other"),
        "loss",
        "Cosine between two modalities' parameter gradients (probe).",
    ),
    _m(
        "loss_norm_exponent",
        "gauge",
        "value",
        (),
        "loss",
        "Fitted beta in w ~ n^beta (1 per-token, 0.5 sqrt, 0 per-sample).",
    ),
    _m(
        "loss_weight_mass",
        "gauge",
        "x",
        ("objective",),
        "loss",
        "Sum of an objective's loss weights over one optimizer step over its declared weight (1 when normalized, I2).",
    ),
    _m(
        "loss_accumulation_exponent",
        "gauge",
        "value",
        ("objective",),
        "loss",
        "log(weight mass) / log(micro-batches): 1 not divided by the accumulation count, 0 normalized.",
    ),
    _m("microbatches", "gauge", "count", (), "loss", "Micro-batches seen in the last optimizer step."),
    _m(
        "optimizer_scale_invariant",
        "gauge",
        "value",
        (),
        "loss",
        "Optimizer family: 1 Adam-like (the step does not grow with the gradient's scale), "
        "0 SGD-like (it does), 0.5 unknown.",
    ),
    _m(
        "token_weight_spread_ratio",
        "gauge",
        "x",
        ("objective", "normalization"),
        "loss",
        "Max/min per-token weight across the step's micro-batches (I3); "
        'normalization="sample" only where per-sample weighting is declared (the spread is then the intent).',
    ),
    # -- 1D parameters (I4)
    _m("param_min", "gauge", "value", ("param",), "params", "Minimum element of a 1D parameter."),
    _m("param_max", "gauge", "value", ("param",), "params", "Maximum element of a 1D parameter."),
    _m("param_absmax", "gauge", "value", ("param",), "params", "Largest absolute element of a 1D parameter."),
    _m(
        "param_drift_log2",
        "gauge",
        "bits",
        ("param",),
        "params",
        "log2(1 + max|x - x_ref| / max(absmax(x_ref), 1e-2 x the median absmax(x_ref) of the model's 1D "
        "parameters)), x_ref the value at attach: bits of range the largest move since attach amounts to (I4).",
    ),
    _m(
        "param_drift_lifetime_log2",
        "gauge",
        "bits",
        ("param",),
        "run",
        "param_drift_log2 over the run's whole life, set by the collector: a job resumed without the "
        "monitor's state measures drift from its own attach; this judges it from the run's first reference "
        "(at least log2(1 + |absmax(x) - a0| / s0)). The figure the collector's alerts judge.",
        "collector",
    ),
    _m(
        "param_drift_reference_absmax",
        "gauge",
        "value",
        ("param",),
        "params",
        "Largest absolute element of a 1D parameter's drift reference (its value at attach).",
    ),
    _m(
        "param_drift_scale",
        "gauge",
        "value",
        ("param",),
        "params",
        "The scale param_drift_log2 divides by: the reference's absmax, or 1e-2 x the median reference "
        "absmax of the model's 1D parameters when that is larger.",
    ),
    _m(
        "param_grad_relative_rms",
        "gauge",
        "x",
        ("param",),
        "params",
        "Gradient RMS over the model's median per-parameter gradient RMS.",
    ),
    _m(
        "param_drift_consistency_ratio",
        "gauge",
        "ratio",
        ("param",),
        "params",
        "|mean sign| of a parameter's recent changes.",
    ),
    _m(
        "param_weight_decay",
        "gauge",
        "value",
        ("param",),
        "params",
        "Weight decay the optimizer applies to the parameter (0: none).",
    ),
    # -- Adam state (I4)
    _m(
        "adam_eps_dominated_ratio",
        "gauge",
        "ratio",
        ("param", "group"),
        "adam",
        "Share of elements with sqrt(v_hat) < eps.",
    ),
    _m(
        "adam_normalized_update_rms",
        "gauge",
        "value",
        ("param", "group"),
        "adam",
        "RMS of m_hat / (sqrt(v_hat) + eps).",
    ),
    _m("adam_exp_avg_norm", "gauge", "norm", ("param", "group"), "adam", "L2 norm of Adam's first moment."),
    _m("adam_exp_avg_sq_norm", "gauge", "norm", ("param", "group"), "adam", "L2 norm of Adam's second moment."),
    _m("optimizer_state_resets_total", "counter", "count", (), "adam", "Optimizer state resets seen."),
    # -- softmax saturation and distillation (I5)
    _m("softmax_top1_prob_mean", "gauge", "ratio", ("task", "role"), "softmax", "Mean top-1 softmax probability."),
    _m(
        "softmax_saturated_ratio",
        "gauge",
        "ratio",
        ("task", "role", "threshold"),
        "softmax",
        "Share of positions whose top-1 probability is above threshold.",
    ),
    _m("softmax_jacobian_mean", "gauge", "value", ("task", "role"), "softmax", "Mean q(1-q) of the top-1 probability."),
    _m("softmax_entropy_nats", "gauge", "nats", ("task", "role"), "softmax", "Mean softmax entropy in nats."),
    _m(
        "softmax_recommended_temperature",
        "gauge",
        "value",
        ("task", "role"),
        "softmax",
        "Temperature that brings mean top-1 to the target (1: none needed).",
    ),
    _m(
        "distill_top1_grad_share_ratio",
        "gauge",
        "ratio",
        ("task",),
        "softmax",
        "Share of the KL gradient on the student's logits at the teacher's top-1.",
    ),
    _m(
        "distill_dark_knowledge_mass",
        "gauge",
        "ratio",
        ("task",),
        "softmax",
        "Mean teacher probability outside its top-1.",
    ),
    # -- packed sequences: samples of one row that see each other
    _m(
        "packing_leak_logit_change",
        "gauge",
        "value",
        ("cause",),
        "packing",
        "Largest change of a packed row's other samples' logits when its first sample's tokens change (0: no leak).",
    ),
    _m(
        "packing_samples_per_row",
        "gauge",
        "ratio",
        (),
        "packing",
        "Mean number of samples packed into one row of the checked micro-batch (reported where rows hold several).",
    ),
    _m(
        "packing_leak_sign",
        "gauge",
        "count",
        ("cause",),
        "packing",
        "1 when a packed micro-batch reaches the model in a way its attention ignores the sample boundaries of.",
    ),
    # -- the hooks' own health
    _m(
        "client_dropped_reports_total",
        "counter",
        "count",
        (),
        "client",
        "Reports the hooks dropped (queue full or collector unreachable).",
    ),
    # -- the collector's own metrics (no run label)
    _m(
        "collector_reports_total",
        "counter",
        "count",
        ("outcome",),
        "collector",
        "Reports the collector accepted, and bodies it rejected, by outcome.",
        "collector",
    ),
    _m(
        "collector_series",
        "gauge",
        "count",
        (),
        "collector",
        "Series the collector holds (its cap: max_series).",
        "collector",
    ),
    _m(
        "collector_state_write_errors_total",
        "counter",
        "count",
        ("write",),
        "collector",
        "Writes to the collector's state file that failed (disk full, file gone), by what was written.",
        "collector",
    ),
    _m(
        "alerts_firing",
        "gauge",
        "count",
        ("alertname", "severity", "run"),
        "collector",
        "Alerts firing now, per rule and run (0 for every rule of a run the collector knows).",
        "collector",
    ),
    _m(
        "alerts_suppressed_total",
        "counter",
        "count",
        ("alertname",),
        "collector",
        "Alerts a rule would have opened in one run past max_alerts_per_rule (counted, not paged).",
        "collector",
    ),
    _m(
        "notifications_total",
        "counter",
        "count",
        ("notifier", "outcome"),
        "collector",
        "Alert notifications by notifier and outcome.",
        "collector",
    ),
    _m(
        "notification_retries_total",
        "counter",
        "count",
        ("notifier",),
        "collector",
        "Retried notification sends (429, 5xx, timeouts, connection errors).",
        "collector",
    ),
    _m(
        "notifications_queued",
        "gauge",
        "count",
        ("notifier",),
        "collector",
        "Notifications waiting in a notifier's queue.",
        "collector",
    ),
)

METRICS: dict[str, MetricSpec] = {s.name: s for s in _SPECS}
"""Every metric of the contract, by wire name."""


def metric_type(name: str) -> MetricType:
    """``counter`` or ``gauge`` for a wire name; unknown names by their suffix."""
    known = METRICS.get(name)
    if known is not None:
        return known.type
    return "counter" if name.endswith("_total") else "gauge"


def exposed_family(name: str) -> str:
    """The family name Prometheus sees (no prefix): a counter ``x_total`` is family ``x``."""
    return name.removesuffix("_total") if metric_type(name) == "counter" else name


def exposed_name(name: str) -> str:
    """The sample name ``/metrics`` shows for a wire name: the prefix, the family, and
    ``_total`` for a counter (what prometheus_client writes for a counter family)."""
    family = PREFIX + exposed_family(name)
    return family + "_total" if metric_type(name) == "counter" else family


def _reserved() -> frozenset[str]:
    out: set[str] = set()
    for spec in _SPECS:
        if spec.owner == "collector":
            family = exposed_family(spec.name)
            # The name itself, its family, and the other type's spelling of the family.
            out.update({spec.name, family, family + "_total"})
    return frozenset(out)


RESERVED_NAMES: frozenset[str] = _reserved()
"""Wire names a sample may not use: the collector exports them itself."""


def labels_of(name: str) -> tuple[str, ...] | None:
    """The labels a known metric carries besides run/rank; None for an unknown name."""
    known = METRICS.get(name)
    return None if known is None else known.labels
