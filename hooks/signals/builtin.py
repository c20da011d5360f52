"""The built-in signals that run from attach: one registration line each, in the
order of their specs (:data:`trainvitals.wire.signals.BUILTIN_SPECS`). Loss accounting,
softmax and the probe are started by the job's calls and options instead; their specs
are in the same catalogue."""

from __future__ import annotations

from trainvitals.hooks.signals.optimizer.adam import AdamState
from trainvitals.hooks.signals.optimizer.stats import OptimizerStats
from trainvitals.hooks.signals.packing.leak import PackingLeak
from trainvitals.hooks.signals.params.signal import ParamHealth
from trainvitals.hooks.signals.registry import register

register(OptimizerStats)
register(ParamHealth)
register(AdamState)
register(PackingLeak)
