"""One alert's state machine: how a verdict on one value moves one (rule, series).

States (:mod:`trainvitals.alerts.state`): inactive -> pending -> firing -> resolved
(-> pending/firing again). The engine (:mod:`trainvitals.alerts.engine`) judges each
value (:func:`threshold_verdict`, then the rule's ``and`` conditions) and hands the
verdict to :func:`advance`; these functions change one :class:`AlertInstance` and
say what changed, and know nothing of other alerts, runs or locks.

- ``for_steps`` counts optimizer steps (the report's ``step``): an alert fires on the
  first report at least ``for_steps`` steps after the one that made it pending, if
  every report of that series in between was past the threshold. ``for`` does the
  same in seconds of ``now``. Both are checked when evidence arrives, as Prometheus
  checks them at evaluation.
- Hysteresis: a firing alert resolves only when the value gets back to ``clear``
  (inclusive), and stays so for ``hold_steps``/``hold`` (:func:`hold_done`). A value
  between ``clear`` and the threshold (:data:`BAND`) keeps it firing; a pending alert
  needs every value past the threshold, so the band resets it.
- A NaN never satisfies ``above``/``below`` and never clears (:data:`UNKNOWN`: the
  state stays as it is); +Inf does satisfy ``above``.
"""

from __future__ import annotations

from trainvitals.alerts.instances import AlertInstance
from trainvitals.alerts.model import Rule, ThresholdRule
from trainvitals.alerts.state import AlertState, Transition

__all__ = [
    "BAD",
    "BAND",
    "CLEAR",
    "UNKNOWN",
    "advance",
    "fire",
    "hold_done",
    "maybe_fire",
    "resolve",
    "threshold_verdict",
]

# Verdicts of one observation.
BAD, BAND, CLEAR, UNKNOWN = "bad", "band", "clear", "unknown"


def threshold_verdict(rule: ThresholdRule, value: float | None) -> str:
    """Past the threshold (:data:`BAD`), back to ``clear`` (:data:`CLEAR`), in between
    (:data:`BAND`), or no evidence (:data:`UNKNOWN`: None or NaN)."""
    if value is None or value != value:
        return UNKNOWN
    if rule.above is not None:
        return BAD if value > rule.above else (CLEAR if value <= rule.clear_at else BAND)
    below = rule.below
    assert below is not None  # the model gives a threshold rule exactly one of above/below
    return BAD if value < below else (CLEAR if value >= rule.clear_at else BAND)


def hold_done(rule: Rule, inst: AlertInstance, step: int | None, now: float) -> bool:
    """The clear streak (or the time since the last event) has lasted ``hold_steps``/``hold``."""
    hold_steps = getattr(rule, "hold_steps", 0)
    hold = getattr(rule, "hold", 0.0)
    if hold_steps and (step is None or inst.clear_step is None or step - inst.clear_step < hold_steps):
        return False
    return inst.clear_time is not None and (hold <= 0 or now - inst.clear_time >= hold)


def advance(inst: AlertInstance, verdict: str, value: float, step: int, now: float) -> Transition | None:
    """Move a threshold rule's alert on one verdict; the transition, if its state changed.

    A pending alert that gets anything but :data:`BAD` goes back to inactive: the caller
    drops it."""
    rule = inst.rule
    old = inst.state
    if old in (AlertState.INACTIVE, AlertState.RESOLVED) and verdict != BAD:
        # A resolved alert keeps the step and value it resolved at, as the transition said
        # them (the job's own log: "resolved at step 41"), not those of later reports.
        return None
    inst.value, inst.step = value, step
    if old in (AlertState.INACTIVE, AlertState.RESOLVED):
        inst.state, inst.pending_step, inst.pending_time = AlertState.PENDING, step, now
        inst.fired_at = inst.resolved_at = None
        inst.reason = ""
        maybe_fire(inst, step, now)
    elif old is AlertState.PENDING:
        if verdict == BAD:
            if step < inst.pending_step:  # the run restarted from an earlier checkpoint
                inst.pending_step = step
            maybe_fire(inst, step, now)
        else:
            inst.state = AlertState.INACTIVE
    else:  # firing
        if verdict != CLEAR:
            inst.clear_step = inst.clear_time = None
        else:
            if inst.clear_step is None or step < inst.clear_step:
                inst.clear_step, inst.clear_time = step, now
            if hold_done(rule, inst, step, now):
                inst.state, inst.resolved_at = AlertState.RESOLVED, now
    if inst.state is old:
        return None
    return inst.snapshot(Transition, old=old)


def maybe_fire(inst: AlertInstance, step: int, now: float) -> None:
    """A pending alert fires once ``for_steps`` and ``for`` have passed since it became pending."""
    rule = inst.rule
    assert isinstance(rule, ThresholdRule)
    if step - inst.pending_step >= rule.for_steps and (rule.for_ <= 0 or now - inst.pending_time >= rule.for_):
        inst.state, inst.fired_at = AlertState.FIRING, now
        inst.fired_value = inst.value
        inst.clear_step = inst.clear_time = None


def fire(inst: AlertInstance, value: float, now: float) -> Transition:
    """An event or silence rule's alert fires at once with ``value`` (it was not firing)."""
    old = inst.state
    inst.fired_value = value
    inst.state, inst.pending_time = AlertState.FIRING, now
    inst.fired_at, inst.resolved_at, inst.reason = now, None, ""
    return inst.snapshot(Transition, old=old)


def resolve(inst: AlertInstance, now: float, reason: str = "") -> Transition:
    """A firing alert resolves; ``reason``: why, when no value cleared it (the run ended)."""
    inst.state, inst.resolved_at = AlertState.RESOLVED, now
    if reason:
        inst.reason = reason
    return inst.snapshot(Transition, old=AlertState.FIRING, reason=reason)
