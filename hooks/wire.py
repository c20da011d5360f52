"""The wire schema: one definition, imported by the hooks (sender) and the collector.

A body is ``{"schema": 1, "reports": [...]}``; see DESIGN.md "Wire format".
This module imports pydantic only (never torch, fastapi or uvicorn), so the
collector can use it without pulling in the training stack.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

SCHEMA_VERSION = 1
PREFIX = "trainvitals_"

# Labels a sample may not carry: Prometheus renames job/instance on scrape, and
# run/rank come from the report itself.
RESERVED_LABELS = frozenset({"job", "instance", "run", "rank"})
MAX_LABELS = 8
MAX_LABEL_VALUE = 256

# name (without prefix) -> (type, help). Both sides read this: the collector for
# HELP/TYPE lines, the hooks to document what they emit. Unknown names are
# accepted as gauges (a newer client talking to an older collector).
METRICS: dict[str, tuple[str, str]] = {
    "step": ("gauge", "Last reported optimizer step."),
    "last_report_timestamp_seconds": ("gauge", "Unix time when the run's last report arrived."),
    "loss": ("gauge", "Mean per-token loss of the last optimizer step, per modality."),
    "grad_norm": ("gauge", "Gradient L2 norm (group=\"all\": global) before the optimizer step."),
    "param_norm": ("gauge", "Parameter L2 norm after the optimizer step."),
    "update_ratio": ("gauge", "RMS(update) / RMS(parameter) of the last optimizer step."),
    "nonfinite_total": ("counter", "Non-finite losses or gradients seen (what=loss|grad)."),
    "modality_sample_share_ratio": ("gauge", "Share of the step's samples per modality."),
    "modality_token_share_ratio": ("gauge", "Share of the step's label tokens per modality."),
    "modality_grad_share_ratio": ("gauge", "Share of the step's loss weight sum(dL/dl) per modality."),
    "modality_dilution_ratio": ("gauge", "Sample share over gradient-weight share per modality (I1)."),
    "modality_grad_norm": ("gauge", "Per-modality gradient norm (scope=output|params)."),
    "modality_grad_cosine": ("gauge", "Cosine between two modalities' parameter gradients (probe)."),
    "loss_norm_exponent": ("gauge", "Fitted beta in w ~ n^beta (1 per-token, 0.5 sqrt, 0 per-sample)."),
    "loss_weight_mass": ("gauge", "Sum of loss weights over one optimizer step (1 when normalized, I2)."),
    "microbatches": ("gauge", "Micro-batches seen in the last optimizer step."),
    "token_weight_spread_ratio": ("gauge", "Max/min per-token weight across the step's micro-batches (I3)."),
    "param_min": ("gauge", "Minimum element of a 1D parameter."),
    "param_max": ("gauge", "Maximum element of a 1D parameter."),
    "param_absmax": ("gauge", "Largest absolute element of a 1D parameter."),
    "param_drift_log2": ("gauge", "log2(absmax / absmax at attach): bits of range gained (I4)."),
    "param_grad_relative_rms": ("gauge", "Gradient RMS over the model's median per-parameter gradient RMS."),
    "param_drift_consistency_ratio": ("gauge", "|mean sign| of a parameter's recent changes."),
    "param_weight_decay": ("gauge", "Weight decay the optimizer applies to the parameter (0: none)."),
    "adam_eps_dominated_ratio": ("gauge", "Share of elements with sqrt(v_hat) < eps."),
    "adam_normalized_update_rms": ("gauge", "RMS of m_hat / (sqrt(v_hat) + eps)."),
    "adam_exp_avg_norm": ("gauge", "L2 norm of Adam's first moment."),
    "adam_exp_avg_sq_norm": ("gauge", "L2 norm of Adam's second moment."),
    "optimizer_state_resets_total": ("counter", "Optimizer state resets seen."),
    "softmax_top1_prob_mean": ("gauge", "Mean top-1 softmax probability."),
    "softmax_saturated_ratio": ("gauge", "Share of positions whose top-1 probability is above threshold."),
    "softmax_jacobian_mean": ("gauge", "Mean q(1-q) of the top-1 probability."),
    "softmax_entropy_nats": ("gauge", "Mean softmax entropy in nats."),
    "softmax_recommended_temperature": ("gauge", "Temperature that brings mean top-1 to the target (1: none needed)."),
    "distill_top1_grad_share_ratio": ("gauge", "Share of the KL gradient on the student's logits at the teacher's top-1."),
    "distill_dark_knowledge_mass": ("gauge", "Mean teacher probability outside its top-1."),
    "client_dropped_reports_total": ("counter", "Reports the hooks dropped (queue full or collector unreachable)."),
}


def metric_type(name: str) -> str:
    """Return "counter" or "gauge" for a wire name."""
    known = METRICS.get(name)
    if known is not None:
        return known[0]
    return "counter" if name.endswith("_total") else "gauge"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")


# Checked by pydantic-core itself (no per-sample Python): a Prometheus label name
# that does not start with "__", and bounded sizes.
LabelName = Annotated[str, StringConstraints(pattern=r"^(?:[a-zA-Z]|_[a-zA-Z0-9])[a-zA-Z0-9_]*$", max_length=64)]
LabelValue = Annotated[str, StringConstraints(max_length=MAX_LABEL_VALUE)]
MetricName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[a-z_][a-z0-9_]*$")]


class Sample(_Strict):
    """One value of one series: the metric name without prefix, labels, value."""

    name: MetricName
    labels: Annotated[dict[LabelName, LabelValue], Field(max_length=MAX_LABELS)] = Field(default_factory=dict)
    # NaN/Inf are legal values (a non-finite grad norm is a signal, not an error).
    value: float


class Event(_Strict):
    """Something that happened once: an optimizer state reset, an audit finding."""

    kind: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-z_][a-z0-9_]*$")]
    detail: Annotated[str, Field(max_length=4096)] = ""
    labels: dict[str, str] = Field(default_factory=dict)


class Report(_Strict):
    """What one rank knows after one reported optimizer step."""

    run: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-/]+$")]
    step: Annotated[int, Field(ge=0)]
    time: float
    rank: Annotated[int, Field(ge=0)] = 0
    samples: list[Sample] = Field(default_factory=list)
    events: list[Event] = Field(default_factory=list)

    @field_validator("time")
    @classmethod
    def _time(cls, v: float) -> float:
        if not math.isfinite(v) or v < 0:
            raise ValueError("time must be a finite Unix timestamp in seconds")
        return v

    @model_validator(mode="after")
    def _sample_names(self) -> Report:
        # One cheap pass per report (the per-field checks run in pydantic-core).
        for i, s in enumerate(self.samples):
            if s.name.startswith(PREFIX):
                raise ValueError(f"samples.{i}.name: {s.name!r} must not carry the {PREFIX!r} prefix")
            if s.labels and not RESERVED_LABELS.isdisjoint(s.labels):
                bad = sorted(RESERVED_LABELS.intersection(s.labels))[0]
                raise ValueError(f"samples.{i}.labels: label {bad!r} is reserved (run/rank come from "
                                 "the report; Prometheus renames job/instance)")
        return self


class ReportBatch(_Strict):
    """The body of ``POST /v1/reports``."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, populate_by_name=True, ser_json_inf_nan="constants"
    )

    schema_version: Literal[1] = Field(alias="schema")
    reports: Annotated[list[Report], Field(min_length=1, max_length=10_000)]

    def to_json(self) -> bytes:
        """Serialize as the wire body (with the ``schema`` key)."""
        return self.model_dump_json(by_alias=True).encode()
