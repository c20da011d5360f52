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
from prometheus_client.utils import floatToGoString as _fmt

from trainvitals.monitor.store import LabelKey, RemovableHandle, RunCopy, SeriesStore
from trainvitals.wire import METRICS, PREFIX, metric_type

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
    return known.help if known is not None else _UNKNOWN_HELP


class StoreCollector(Collector):
    """Yields the store's series, the collector's own counters, and registered families."""

    def __init__(self, store: SeriesStore, reports: ReportCounter | None = None) -> None:
        self.store = store
        self.reports = reports if reports is not None else ReportCounter()
        self._sources: list[FamilySource] = []
        self._lock = threading.Lock()
        self._render_lock = threading.Lock()
        # (run, rank, wire name) -> {label items: rendered "name{labels} "}
        self._prefixes: dict[tuple[str, int, str], dict[LabelKey, str]] = {}

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

        yield from self._extra_families(snap.series_count)

    def _extra_families(self, series_count: int) -> Iterator[Metric]:
        """The collector's own metrics, then the registered sources' families."""
        outcomes = CounterMetricFamily(
            PREFIX + "collector_reports_total",
            _help("collector_reports_total"),
            labels=["outcome"],
        )
        for outcome, count in self.reports.values().items():
            outcomes.add_metric([outcome], count)
        yield outcomes
        yield GaugeMetricFamily(
            PREFIX + "collector_series", _help("collector_series"), value=series_count
        )
        with self._lock:
            sources = list(self._sources)
        for source in sources:
            try:
                yield from list(source())
            except Exception:
                log.exception("metric family source %r failed; skipped in this scrape", source)

    def render(self) -> bytes:
        """The text exposition, as ``generate_latest`` would write it, faster.

        The store's series are written from cached line prefixes (name and
        label set, escaped once per series), not through ``Sample`` objects;
        the collector's own families and the registered sources go through
        ``generate_latest``. At 100,000 series this is what keeps a scrape
        under DESIGN's 1 s budget.
        """
        with self._render_lock:
            runs = self.store.copy_runs()
            series_count = len(self.store)
            old, cache = self._prefixes, {}
            step_lines: list[str] = []
            last_lines: list[str] = []
            by_name: dict[str, list[str]] = {}
            for run, step, last, _ in sorted(runs, key=_run_name):
                run_labels = f'{{run="{_escape(run)}"}} '
                step_lines.append(f"{PREFIX}step{run_labels}{_fmt(step)}\n")
                last_lines.append(
                    f"{PREFIX}last_report_timestamp_seconds{run_labels}{_fmt(last)}\n"
                )
            for run, _, _, per_rank in runs:
                for rank, fams in per_rank:
                    for name, series in fams:
                        key = (run, rank, name)
                        prefixes = old.get(key)
                        if prefixes is None:
                            prefixes = {}
                        cache[key] = prefixes
                        lines = by_name.get(name)
                        if lines is None:
                            lines = by_name[name] = []
                        append = lines.append
                        for label_items, value in series:
                            prefix = prefixes.get(label_items)
                            if prefix is None:
                                prefix = prefixes[label_items] = _line_prefix(
                                    name, run, rank, label_items
                                )
                            append(prefix + _fmt(value))
            self._prefixes = cache  # drops the prefixes of expired runs

        out = [_header("step"), *step_lines, _header("last_report_timestamp_seconds"), *last_lines]
        for name in sorted(by_name):
            out.append(_header(name))
            lines = by_name[name]
            out.append("\n".join(lines))
            out.append("\n")
        text = "".join(out).encode()
        return text + generate_latest(_Families(self._extra_families(series_count)))


class _Families:
    """Adapts an iterable of families to what ``generate_latest`` reads."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def _run_name(run: RunCopy) -> str:
    return run[0]


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _exposed_name(name: str) -> str:
    """The sample name ``generate_latest`` writes for a wire name."""
    if metric_type(name) == "counter":
        return PREFIX + name.removesuffix("_total") + "_total"
    return PREFIX + name


def _header(name: str) -> str:
    exposed = _exposed_name(name)
    help_text = _help(name).replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {exposed} {help_text}\n# TYPE {exposed} {metric_type(name)}\n"


def _line_prefix(name: str, run: str, rank: int, label_items: LabelKey) -> str:
    labels = [*label_items, ("run", run)]
    if rank:
        labels.append(("rank", str(rank)))
    labels.sort()
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return f"{_exposed_name(name)}{{{inner}}} "


def make_registry(
    store: SeriesStore, reports: ReportCounter | None = None
) -> tuple[CollectorRegistry, StoreCollector]:
    """A private registry holding only a :class:`StoreCollector` over ``store``."""
    registry = CollectorRegistry(auto_describe=False)
    collector = StoreCollector(store, reports)
    registry.register(collector)
    return registry, collector


def render(registry: CollectorRegistry) -> bytes:
    """Prometheus text exposition of ``registry`` (``generate_latest``)."""
    return generate_latest(registry)
