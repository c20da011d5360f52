"""Prometheus exposition: the text ``/metrics`` serves, written from the store at scrape time.

:meth:`StoreCollector.render` is the one exposition path: it reads
:meth:`SeriesStore.copy_runs`, so series of expired runs simply vanish, and
writes what ``prometheus_client.generate_latest`` would write for the same
families (checked by the tests with prometheus_client's parser and promtool).
Other components add families through :meth:`StoreCollector.register_family_source`
(the alert service exports ``trainvitals_alerts_firing`` this way).

Names, types and HELP text come from the wire metric table
(:data:`trainvitals.wire.METRICS`, listed in ``docs/metrics.md``); labels of a
run's series from :func:`trainvitals.wire.series_labels`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.utils import floatToGoString as _fmt

from trainvitals.monitor.handles import RemovableHandle
from trainvitals.monitor.series import LabelKey, RunCopy
from trainvitals.monitor.store import SeriesStore
from trainvitals.wire import METRICS, PREFIX, exposed_name, metric_type, series_labels

__all__ = ["REPORT_OUTCOMES", "FamilySource", "ReportCounter", "StoreCollector"]

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
    "run_series_limit",
    "duplicate",
    "state_unwritable",
)
# HELP of a metric a client sent that the wire table does not know (not one of ours).
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


class StoreCollector:
    """Writes the store's series, the collector's own metrics and registered families."""

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

    def render(self) -> bytes:
        """The text exposition (format 0.0.4), as ``generate_latest`` would write it.

        The store's series are written from cached line prefixes (name and
        label set, escaped once per series) rather than through
        ``prometheus_client`` sample objects: at 100,000 series this keeps a
        scrape well under a second. The collector's own families and the
        registered sources are few and go through ``generate_latest``.
        Families are ordered: the per-run series (step, last report time,
        run_ended), the samples' metrics by name, then the collector's own.
        """
        with self._render_lock:
            runs = self.store.copy_runs()
            series_count = len(self.store)
            old, cache = self._prefixes, {}
            step_lines: list[str] = []
            last_lines: list[str] = []
            ended_lines: list[str] = []
            by_name: dict[str, list[str]] = {}
            for run, step, last, ended, _ in sorted(runs, key=_run_name):
                run_labels = _labels(series_labels(run, 0, {}).items())
                step_lines.append(f"{PREFIX}step{run_labels}{_fmt(step)}\n")
                last_lines.append(f"{PREFIX}last_report_timestamp_seconds{run_labels}{_fmt(last)}\n")
                if ended:
                    ended_lines.append(f"{PREFIX}run_ended{run_labels}{_fmt(1)}\n")
            for run, _, _, _, per_rank in runs:
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
                                labels = series_labels(run, rank, dict(label_items))
                                prefix = prefixes[label_items] = _exposed_name(name) + _labels(labels.items())
                            append(prefix + _fmt(value))
            self._prefixes = cache  # drops the prefixes of expired runs

        out = [
            _header("step"),
            *step_lines,
            _header("last_report_timestamp_seconds"),
            *last_lines,
            _header("run_ended"),
            *ended_lines,
        ]
        for name in sorted(by_name):
            out.append(_header(name))
            out.append("\n".join(by_name[name]))
            out.append("\n")
        text = "".join(out).encode()
        return text + generate_latest(_Families(self._own_families(series_count)))

    def _own_families(self, series_count: int) -> Iterator[Metric]:
        """The collector's own metrics, then the registered sources' families."""
        outcomes = CounterMetricFamily(
            PREFIX + "collector_reports_total",
            _help("collector_reports_total"),
            labels=METRICS["collector_reports_total"].labels,
        )
        for outcome, count in self.reports.values().items():
            outcomes.add_metric([outcome], count)
        yield outcomes
        yield GaugeMetricFamily(PREFIX + "collector_series", _help("collector_series"), value=series_count)
        with self._lock:
            sources = list(self._sources)
        for source in sources:
            try:
                yield from list(source())
            except Exception:
                log.exception("metric family source %r failed; skipped in this scrape", source)


class _Families:
    """Adapts an iterable of families to what ``generate_latest`` reads."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def _run_name(run: RunCopy) -> str:
    return run[0]


def _escape(value: str) -> str:
    """A label value escaped as the text format requires (backslash, newline, quote)."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _labels(items: Iterable[tuple[str, str]]) -> str:
    """``{k="v",...} `` with names sorted, as ``generate_latest`` orders them."""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(items))
    return f"{{{inner}}} "


def _exposed_name(name: str) -> str:
    """The sample name ``generate_latest`` writes for a wire name."""
    return exposed_name(name)


def _header(name: str) -> str:
    exposed = _exposed_name(name)
    help_text = _help(name).replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {exposed} {help_text}\n# TYPE {exposed} {metric_type(name)}\n"
