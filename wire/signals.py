"""The signal registry: each signal declared once, every list of signal names derived.

A :class:`SignalSpec` says what the rest of the system needs to know about a signal
without running it: its name (the coverage entry's ``signal``, and the ``signals=``
name of a signal chosen at attach), the metric catalogue group it reports under, the
words coverage uses for it, where its figures go on the dashboards and in the metric
reference, and whether live settings may turn it on and off. It is plain data, with
no torch: the collector, the alert engine and the generators read it; the training
side's :mod:`trainvitals.hooks.signals.registry` pairs it with the ``Signal`` class
that measures it.

A built-in signal declares its spec on its ``Signal`` class, in its family's package
under ``trainvitals.hooks.signals``; the collector knows them without importing the
hooks (nor torch) from :data:`BUILTIN_SPECS`, generated from those classes into
:mod:`trainvitals.wire.builtin_signals` in the order coverage lists them (with the
metrics a spec declares, which join the catalogue here). A signal defined elsewhere (a plugin, a test) is added with
:func:`register_spec`, which the hooks' ``register(SignalClass)`` calls; what is
derived from the registry (:data:`SIGNALS`, :data:`SELECTABLE`, the metric
catalogue's groups, the reference, the dashboards' homes) follows at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import overload

from trainvitals.wire.builtin_signals import BUILTIN_SPECS
from trainvitals.wire.metrics import METRICS
from trainvitals.wire.signal_spec import OVERVIEW_DASHBOARD, SignalSpec

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

_lock = threading.Lock()
_registry: dict[str, SignalSpec] = {}


def _add(spec: SignalSpec) -> SignalSpec:
    """Check ``spec`` against the registry and the catalogue, then add it and its
    metrics (their group set to its own); the caller holds the lock. ValueError,
    changing nothing, for a clash."""
    metrics = tuple(replace(m, group=spec.group or "") for m in spec.metrics)
    spec = replace(spec, metrics=metrics)
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


for _spec in BUILTIN_SPECS:  # the generated catalogue, and the metrics its specs declare
    _add(_spec)


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
    with _lock:
        return _add(spec)


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
