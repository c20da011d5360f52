"""The training side of the signal registry: which ``Signal`` class measures each
selectable signal (:class:`~trainvitals.wire.signals.SignalSpec` with ``selectable``).

``register(SignalClass)`` is the one line that adds a signal: it registers the class's
spec (``SignalClass.spec``, or the built-in spec named by its ``covers``) with
:func:`trainvitals.wire.signals.register_spec`, so coverage, live settings, the
collector's catalogue, the reference and the dashboards know it, and lists the class
among those a monitor runs from attach (:func:`builtin_signal_classes`). The built-in
signals are listed in :mod:`trainvitals.hooks.signals.builtin` and registered here,
once, the first time a monitor asks for them.
"""

from __future__ import annotations

import importlib
import threading
from typing import TypeVar

from trainvitals.hooks.signals.base import Signal
from trainvitals.wire.signals import SELECTABLE, SignalSpec, register_spec, spec_of, unregister_spec

__all__ = ["builtin_signal_classes", "register", "unregister"]

S = TypeVar("S", bound=type[Signal])

_lock = threading.Lock()
_classes: dict[str, type[Signal]] = {}
_BUILTIN = "trainvitals.hooks.signals.builtin"
_builtin_done = False
_REGENERATE = "python -m trainvitals.hooks.signals.catalogue --write"


def register(cls: S) -> S:
    """Register the signal ``cls`` measures; returns ``cls`` (so it also works as a class
    decorator). ValueError, changing nothing, when the spec clashes with a registered
    one, or ``cls`` declares neither a ``spec`` nor the ``covers`` of a registered one."""
    spec: SignalSpec | None = cls.spec if cls.spec is not None else spec_of(cls.covers or "")
    if spec is None:
        raise ValueError(f"{cls.__name__}: declare its SignalSpec as the class attribute spec")
    if cls.covers not in (None, spec.name):
        raise ValueError(f"{cls.__name__}: covers {cls.covers!r} is not its spec's name {spec.name!r}")
    spec = register_spec(spec)
    cls.spec, cls.covers = spec, spec.name
    if spec.selectable:
        with _lock:
            _classes[spec.name] = cls
    return cls


def unregister(cls: type[Signal]) -> None:
    """Undo :func:`register` for a signal that is not built in (a test's toy signal)."""
    name = cls.covers or ""
    unregister_spec(name)
    with _lock:
        if _classes.get(name) is cls:
            del _classes[name]


def builtin_signal_classes() -> dict[str, type[Signal]]:
    """The signals a monitor runs from attach, by their ``signals=`` name, in the order
    they run (the registry's): the built-in ones and any registered since."""
    global _builtin_done
    if not _builtin_done:
        for cls in importlib.import_module(_BUILTIN).BUILTIN:
            if issubclass(cls, Signal):
                try:
                    register(cls)
                except ValueError as e:  # its class says otherwise than the generated catalogue
                    raise ValueError(f"{e}: wire/builtin_signals.py is stale; run {_REGENERATE}") from e
        _builtin_done = True
    with _lock:
        return {name: _classes[name] for name in SELECTABLE if name in _classes}
