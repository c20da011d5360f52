"""The wire schema: a body is ``{"schema": 1, "reports": [...]}``; see ``docs/wire.md``.

pydantic only (never torch, fastapi or uvicorn): the hooks validate what they
send with it, the collector what it receives.
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

from trainvitals.wire.metrics import PREFIX

__all__ = ["MAX_LABELS", "MAX_LABEL_VALUE", "RESERVED_LABELS", "RUN_END_EVENT", "SCHEMA_VERSION", "Event", "Report",
           "ReportBatch", "Sample"]

SCHEMA_VERSION = 1

RUN_END_EVENT = "run_end"
"""The event ``Monitor.close()`` sends: the run ended on purpose (no RunSilent for it)."""

# Labels a sample may not carry: Prometheus renames job/instance on scrape, and
# run/rank come from the report itself.
RESERVED_LABELS = frozenset({"job", "instance", "run", "rank"})
MAX_LABELS = 8
MAX_LABEL_VALUE = 256


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
