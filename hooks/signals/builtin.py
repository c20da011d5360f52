"""The built-in signals: one line each in :data:`BUILTIN`, in the order coverage lists
them. Each class declares its :class:`~trainvitals.wire.signals.SignalSpec` as its
``spec``; ``python -m trainvitals.hooks.signals.catalogue --write`` writes those specs
into ``wire/builtin_signals.py``, the catalogue the collector reads without importing
the hooks. The selectable ones run from attach
(:func:`trainvitals.hooks.signals.registry.builtin_signal_classes` registers them);
loss accounting, softmax and the probe are started by the job's calls and options."""

from __future__ import annotations

from trainvitals.hooks.signals.base import Signal
from trainvitals.hooks.signals.loss.probe import ModalityProbe
from trainvitals.hooks.signals.loss.signal import LossAccounting
from trainvitals.hooks.signals.optimizer.adam import AdamState
from trainvitals.hooks.signals.optimizer.stats import OptimizerStats
from trainvitals.hooks.signals.packing.leak import PackingLeak
from trainvitals.hooks.signals.params.signal import ParamHealth
from trainvitals.hooks.signals.softmax.signal import Softmax

__all__ = ["BUILTIN", "Declared"]

Declared = type[Signal] | type[ModalityProbe]
"""A class that declares a signal's spec: a ``Signal``, or the probe (which the loss
accounting runs rather than the monitor)."""

BUILTIN: tuple[Declared, ...] = (
    OptimizerStats,
    ParamHealth,
    AdamState,
    LossAccounting,
    ModalityProbe,
    Softmax,
    PackingLeak,
)
"""The built-in signals, in the order coverage lists them."""
