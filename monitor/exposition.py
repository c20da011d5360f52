"""Prometheus exposition: a custom collector that reads the store at scrape time.

Each scrape builds fresh metric families from :meth:`SeriesStore.snapshot`, so
series of expired runs simply vanish. Other components add families through
:meth:`StoreCollector.register_family_source` (the alert engine exports
``trainvitals_alerts_firing`` this way).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from trainvitals.hooks.wire import METRICS, PREFIX
from trainvitals.monitor.store import RemovableHandle, SeriesStore

__all__ = [
    "REPORT_OUTCOMES",
    "FamilySource",
    "ReportCounter",
    "StoreCollector",
    "make_registry",
    "render",
]

log = logging.getLogger(__name__)

# Values of trainvitals_collector_reports_total{outcome}.
REPORT_OUTCOMES = (
    "accepted",
    "invalid",
    "too_large",
    "unsupported_media",
    "unauthorized",
    "bad_gzip",
    "series_limit",
)
_UNKNOWN_HELP = "Sent by a trainvitals client; not in this collector's metric catalogue."

FamilySource = Callable[[], Iterable[Metric]]


class ReportCounter:
    """Thread-safe counts of ingest outcomes (one of :data:`REPORT_OUTCOMES`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(REPORT_OUTCOMES, 0)

    def inc(self, outcome: str, n: int = 1) -> None:
        """Add ``n`` to ``outcome``."""
        if outcome not in self._counts:
            raise ValueError(f"unknown outcome {outcome!r}; expected one of {REPORT_OUTCOMES}")
        with self._lock:
            self._counts[outcome] += n

    def values(self) -> dict[str, int]:
        """A copy of the counts, every outcome present."""
        with self._lock:
            return dict(self._counts)


def _help(name: str) -> str:
    known = METRICS.get(name)
    return known[1] if known is not None else _UNKNOWN_HELP


class StoreCollector(Collector):
    """Yields the store's series, the collector's own counters, and registered families."""

    def __init__(self, store: SeriesStore, reports: ReportCounter | None = None) -> None:
        self.store = store
        self.reports = reports if reports is not None else ReportCounter()
        self._sources: list[FamilySource] = []
        self._lock = threading.Lock()

    def register_family_source(self, source: FamilySource) -> RemovableHandle:
        """Add ``source() -> iterable of MetricFamily`` to every scrape.

        Family names must start with ``trainvitals_`` and not clash with the
        store's. A source that raises is logged and skipped for that scrape.
        """
        with self._lock:
            self._sources.append(source)

        def remove() -> None:
            with self._lock:
                if source in self._sources:
                    self._sources.remove(source)

        return RemovableHandle(remove)

    def describe(self) -> list[Metric]:
        """Nothing up front: the series exist only at scrape time."""
        return []

    def collect(self) -> Iterator[Metric]:
        """Build fresh families from a store snapshot."""
        snap = self.store.snapshot()

        step = GaugeMetricFamily(PREFIX + "step", _help("step"))
        last = GaugeMetricFamily(
            PREFIX + "last_report_timestamp_seconds", _help("last_report_timestamp_seconds")
        )
        for run in snap.runs:
            labels = {"run": run.run}
            step.samples.append(Sample(step.name, labels, float(run.step)))
            last.samples.append(Sample(last.name, labels, run.last_report_time))
        yield step
        yield last

        for full_name, kind, series in snap.families:
            help_text = _help(full_name[len(PREFIX) :])
            family: Metric
            if kind == "counter":
                family = CounterMetricFamily(full_name, help_text)
                sample_name = family.name + "_total"
            else:
                family = GaugeMetricFamily(full_name, help_text)
                sample_name = full_name
            # Samples appended directly: add_metric() would zip label names per series.
            family.samples = [Sample(sample_name, labels, value) for labels, value in series]
            yield family

        outcomes = CounterMetricFamily(
            PREFIX + "collector_reports_total",
            "Reports the collector accepted, and bodies it rejected, by outcome.",
            labels=["outcome"],
        )
        for outcome, count in self.reports.values().items():
            outcomes.add_metric([outcome], count)
        yield outcomes
        yield GaugeMetricFamily(
            PREFIX + "collector_series",
            "Series the collector holds (its cap: max_series).",
            value=snap.series_count,
        )

        with self._lock:
            sources = list(self._sources)
        for source in sources:
            try:
                yield from list(source())
            except Exception:
                log.exception("metric family source %r failed; skipped in this scrape", source)


def make_registry(
    store: SeriesStore, reports: ReportCounter | None = None
) -> tuple[CollectorRegistry, StoreCollector]:
    """A private registry holding only a :class:`StoreCollector` over ``store``."""
    registry = CollectorRegistry(auto_describe=False)
    collector = StoreCollector(store, reports)
    registry.register(collector)
    return registry, collector


def render(registry: CollectorRegistry) -> bytes:
    """Prometheus text exposition of ``registry``."""
    return generate_latest(registry)
