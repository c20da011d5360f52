"""The optimizer-state signal (docs/incidents.md, I4): one walk over the optimizer's
state per report feeds the reset detector
(:mod:`~trainvitals.hooks.signals.optimizer.resets`) and Adam's moment statistics
(:mod:`~trainvitals.hooks.signals.optimizer.adam_moments`). Host checks compare object
identities only (:mod:`~trainvitals.hooks.signals.optimizer.state`), so a reset that
happened between reports is seen and nothing here needs every step.
"""

from __future__ import annotations

from typing import Any

from trainvitals.hooks.signals.base import MonitorView, Removable, Signal
from trainvitals.hooks.signals.optimizer.adam_moments import AdamMoments
from trainvitals.hooks.signals.optimizer.resets import ResetDetector
from trainvitals.hooks.signals.optimizer.state import Anchors, StateWalk, stack_steps
from trainvitals.hooks.signals.param_series import groups_key
from trainvitals.hooks.step import StepContext
from trainvitals.wire.signals import SignalSpec


class AdamState(Signal):
    spec = SignalSpec(
        name="adam",
        covers="Adam moments (I4)",
        how_to_ask="signals= leaves out 'adam'",
        group="adam",
        title="Adam state (I4)",
        dashboard="trainvitals-params.json",
        selectable=True,
        per_parameter_sums=True,
        per_param_series=True,
    )
    covers = spec.name

    def __init__(self) -> None:
        self._anchors: Anchors = {}
        self._resets: ResetDetector | None = None
        self._moments = AdamMoments()
        self._last: StateWalk | None = None
        self._last_key: tuple[Any, ...] | None = None

    def _walk(self, monitor: MonitorView, key: tuple[Any, ...] | None = None) -> StateWalk:
        """The state walk; the previous one again when, by identities, a new walk
        would see the same (the usual report: a walk is a Python loop over every
        parameter's state)."""
        last = self._last
        if last is not None and key is not None and key == self._last_key and last.unchanged(monitor):
            return last
        walk = StateWalk(monitor, self._anchors)
        self._anchors = walk.anchors
        self._last, self._last_key = walk, key
        return walk

    def bind(self, monitor: MonitorView) -> list[Removable]:
        walk = self._walk(monitor)
        steps = stack_steps(walk.steps, monitor.device) if walk.steps else None
        self._resets = ResetDetector(monitor, walk, steps)
        # Not every optimizer-like object has load-state hooks (torch's own do).
        register = getattr(monitor.optimizer, "register_load_state_dict_pre_hook", None)
        return [register(self._state_replaced)] if callable(register) else []

    def _state_replaced(self, optimizer: Any, state_dict: Any) -> None:
        """Before ``optimizer.load_state_dict`` replaces every state tensor: let go of the
        old ones now. The kept walk and the moments' views would otherwise hold them (a
        second copy of Adam's memory) until the next report; the reset detector keeps
        only weak anchors, so it still sees the states recreated."""
        self._last = self._last_key = None
        self._moments.close()

    def collect(self, monitor: MonitorView, ctx: StepContext) -> None:
        key = groups_key(monitor)
        walk = self._walk(monitor, key)
        now = stack_steps(walk.steps, monitor.device) if walk.steps else None
        assert self._resets is not None
        self._resets.observe(monitor, ctx, walk, now)
        if walk.entries and now is not None:
            self._moments.collect(monitor, ctx, key, walk, now)
        else:
            ctx.inactive_when(
                "adam",
                None,
                "not_adam",
                f"{type(monitor.optimizer).__name__} keeps no Adam moments (exp_avg, exp_avg_sq) in its state",
            )

    def state_dict(self) -> dict[str, Any]:
        if self._resets is None:
            return {}
        return {"resets": self._resets.count.reshape(()).cpu(), "report_step": self._resets.report_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._resets is not None and state.get("resets") is not None:
            self._resets.count = state["resets"].reshape(1).to(self._resets.count.device)
            # Steps elapsed since the last report are counted from the saved one.
            self._resets.report_step = int(state.get("report_step", self._resets.report_step))

    def close(self) -> None:
        self._moments.close()
        self._anchors.clear()
        self._last = None
        self._resets = None
