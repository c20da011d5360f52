"""The wire contract between the hooks (sender) and the collector (receiver).

Owned by neither side: both import it, and it imports pydantic only (no torch,
fastapi or uvicorn). ``docs/wire.md`` describes the format; ``docs/metrics.md``
lists the metrics (generated from :mod:`trainvitals.wire.metrics`).
"""

from __future__ import annotations

from trainvitals.wire.body import encode_body, encode_report
from trainvitals.wire.metrics import (
    METRICS,
    PREFIX,
    RESERVED_NAMES,
    MetricSpec,
    exposed_family,
    exposed_name,
    labels_of,
    metric_type,
)
from trainvitals.wire.schema import (
    RESERVED_LABELS,
    RUN_END_EVENT,
    SCHEMA_VERSION,
    Coverage,
    Event,
    Report,
    ReportBatch,
    Sample,
    ends_run,
)
from trainvitals.wire.series import series_labels

__all__ = [
    "METRICS",
    "PREFIX",
    "RESERVED_LABELS",
    "RESERVED_NAMES",
    "RUN_END_EVENT",
    "SCHEMA_VERSION",
    "Coverage",
    "Event",
    "MetricSpec",
    "Report",
    "ReportBatch",
    "Sample",
    "encode_body",
    "encode_report",
    "ends_run",
    "exposed_family",
    "exposed_name",
    "labels_of",
    "metric_type",
    "series_labels",
]
