"""The signal registry: each signal declared once, every list of signal names derived.

A :class:`SignalSpec` says what the rest of the system needs to know about a signal
without running it: its name (the coverage entry's ``signal``, and the ``signals=``
name of a signal chosen at attach), the metric catalogue group it reports under, the
words coverage uses for it, where its figures go on the dashboards and in the metric
reference, and whether live settings may turn it on and off. It is plain data, with
no torch: the collector, the alert engine and the generators read it; the training
side's :mod:`trainvitals.hooks.signals.registry` pairs it with the ``Signal`` class
that measures it.

The built-in signals are declared here (:data:`BUILTIN_SPECS`), in the order
coverage lists them, so that a collector knows them without importing the hooks
(nor torch). A signal defined elsewhere (a plugin, a test) is added with
:func:`register_spec`, which the hooks' ``register(SignalClass)`` calls; what is
derived from the registry (:data:`SIGNALS`, :data:`SELECTABLE`, the metric
catalogue's groups, the reference, the dashboards' homes) follows at once.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import overload

from trainvitals.wire.metrics import METRICS, MetricSpec

__all__ = [
    "BUILTIN_SPECS",
    "OVERVIEW_DASHBOARD",
    "SELECTABLE",
    "SIGNALS",
    "SignalNames",
    "SignalSpec",
    "metric_groups",
    "register_spec",
    "signal_specs",
    "spec_of",
    "unregister_spec",
]

OVERVIEW_DASHBOARD = "trainvitals-overview.json"
"""The dashboard a signal's uncurated metrics go on unless its spec names another."""

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


@dataclass(frozen=True)
class SignalSpec:
    """One signal, as everything but its own measuring code sees it."""

    name: str
    """Its coverage name (``trainvitals_signal_active{signal=...}``) and, when
    :attr:`selectable`, its ``signals=`` name: lower case, digits, ``_``; 32 at most."""
    covers: str
    """What it measures, in a few words (the coverage documentation)."""
    how_to_ask: str
    """The coverage detail while it does not run (reason ``not_requested``): what would start it."""
    group: str | None = None
    """Its group in the metric catalogue, its own name or None (:data:`trainvitals.wire.metrics.METRICS`), the
    figures whose arrival the verdict counts for it in reports from before coverage;
    None: it reports under another signal's group (``probe`` under ``loss``)."""
    title: str = ""
    """The heading of its group in the metric reference (``docs/metrics.md``)."""
    dashboard: str = OVERVIEW_DASHBOARD
    """The dashboard file its group's metrics without a curated panel go on."""
    selectable: bool = False
    """It runs from attach unless ``signals=`` (or a live settings change) leaves it out;
    False: a call of the job's starts it (``first_call``) or an option does."""
    first_call: str | None = None
    """The job's call that starts it (``track_loss()``): at attach it is "not requested yet"."""
    per_parameter_sums: bool = False
    """Its figures sum per-parameter pieces over ranks: it is withheld (coverage
    ``sharded``) when the parameters' layout over ranks is not understood."""
    per_param_series: bool = False
    """It chooses its per-parameter series when it binds (``per_param=``): a live settings
    change of ``per_param`` binds it again."""
    metrics: tuple[MetricSpec, ...] = field(default=())
    """Metrics it adds to the catalogue (their group is set to :attr:`group`). The
    built-in signals' metrics are in the catalogue itself, under their group."""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(
                f"signal name {self.name!r}: lower case letters, digits and _ (a letter first), 32 at most"
            )
        if self.group not in (None, self.name):
            raise ValueError(f"signal {self.name!r}: its metric group is its name, or None (got {self.group!r})")
        if self.metrics and self.group is None:
            raise ValueError(f"signal {self.name!r}: metrics need a group to be listed under")


BUILTIN_SPECS: tuple[SignalSpec, ...] = (
    SignalSpec(
        "optimizer",
        "gradient and parameter norms, update ratios",
        "signals= leaves out 'optimizer'",
        group="optimizer",
        title="Optimizer step",
        selectable=True,
        per_parameter_sums=True,
    ),
    SignalSpec(
        "params",
        "1D parameter drift (I4)",
        "signals= leaves out 'params'",
        group="params",
        title="1D parameters (I4)",
        dashboard="trainvitals-params.json",
        selectable=True,
        per_parameter_sums=True,
        per_param_series=True,
    ),
    SignalSpec(
        "adam",
        "Adam moments (I4)",
        "signals= leaves out 'adam'",
        group="adam",
        title="Adam state (I4)",
        dashboard="trainvitals-params.json",
        selectable=True,
        per_parameter_sums=True,
        per_param_series=True,
    ),
    SignalSpec(
        "loss",
        "loss accounting, I1-I3: track_loss or zero-code from the logits",
        "no track_loss() call and no attach(loss_from_logits=...)",
        group="loss",
        title="Loss accounting (I1-I3)",
        dashboard="trainvitals-loss.json",
        first_call="track_loss()",
    ),
    SignalSpec(
        "probe",
        "the per-modality gradient probe, probe_every",
        "attach(probe_every=N) is off",
    ),
    SignalSpec(
        "softmax",
        "saturation and distillation (I5)",
        "no observe_logits() or observe_distillation() call",
        group="softmax",
        title="Softmax saturation and distillation (I5)",
        dashboard="trainvitals-softmax.json",
        first_call="observe_logits()",
    ),
    SignalSpec(
        "packing",
        "packed sequences: samples of one row that see each other",
        "signals= leaves out 'packing'",
        group="packing",
        title="Packed sequences: samples leaking into each other",
        selectable=True,
    ),
)
"""The built-in signals, in the order coverage lists them."""

_lock = threading.Lock()
_registry: dict[str, SignalSpec] = {s.name: s for s in BUILTIN_SPECS}


def signal_specs() -> tuple[SignalSpec, ...]:
    """Every registered signal, built-in first, then in the order they were registered."""
    with _lock:  # a registration on another thread must not change the dict mid-copy
        return tuple(_registry.values())


def spec_of(name: str) -> SignalSpec | None:
    """The registered signal called ``name``, or None."""
    return _registry.get(name)


def register_spec(spec: SignalSpec) -> SignalSpec:
    """Add a signal (and the metrics it declares) to the registry; returns the spec as
    registered (its metrics' group set to its own). Registering an equal spec again is
    a no-op. ValueError, changing nothing, for a name taken by another spec or a metric
    name the catalogue has."""
    metrics = tuple(replace(m, group=spec.group or "") for m in spec.metrics)
    spec = replace(spec, metrics=metrics)
    with _lock:
        known = _registry.get(spec.name)
        if known == spec:
            return known
        if known is not None:
            raise ValueError(f"signal {spec.name!r} is registered already, declared otherwise")
        for m in metrics:
            if m.name in METRICS:
                raise ValueError(f"signal {spec.name!r}: metric {m.name!r} is in the catalogue already")
        if len({m.name for m in metrics}) != len(metrics):
            raise ValueError(f"signal {spec.name!r}: a metric is declared twice")
        for m in metrics:
            METRICS[m.name] = m
        _registry[spec.name] = spec
    return spec


def unregister_spec(name: str) -> None:
    """Take a registered signal and its own metrics out again (a test's toy signal);
    the built-in signals stay. ValueError for a built-in name."""
    if any(s.name == name for s in BUILTIN_SPECS):
        raise ValueError(f"signal {name!r} is built in")
    with _lock:
        spec = _registry.pop(name, None)
        for m in spec.metrics if spec is not None else ():
            METRICS.pop(m.name, None)


def metric_groups() -> tuple[SignalSpec, ...]:
    """The signals that own a metric catalogue group, in the catalogue's order (the
    order of the metric reference and the verdict)."""
    owners = {s.group: s for s in signal_specs() if s.group is not None}
    seen: dict[str, SignalSpec] = {}
    for m in METRICS.values():
        if m.group in owners and m.group not in seen:
            seen[m.group] = owners[m.group]
    return tuple(seen.values()) + tuple(s for g, s in owners.items() if g not in seen)


class SignalNames(Sequence[str]):
    """The names of the registered signals a predicate keeps, in registry order, read
    from the registry at each use (a tuple taken at import would miss a signal
    registered later). Compares equal to a sequence with the same names."""

    def __init__(self, keep: Callable[[SignalSpec], bool], doc: str = "") -> None:
        self._keep = keep
        self.__doc__ = doc

    def _names(self) -> tuple[str, ...]:
        return tuple(s.name for s in signal_specs() if self._keep(s))

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[str, ...]: ...
    def __getitem__(self, i: int | slice) -> str | tuple[str, ...]:
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        spec = _registry.get(name) if isinstance(name, str) else None
        return spec is not None and self._keep(spec)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (SignalNames, tuple, list)):
            return self._names() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


SIGNALS = SignalNames(lambda s: True, "Every registered signal: what a report's coverage speaks for.")
SELECTABLE = SignalNames(
    lambda s: s.selectable,
    "The signals that run from attach and that ``signals=`` and live settings choose among.",
)
