"""Optimizer state resets (docs/incidents.md, I4): a reset restarts the period where
Adam's second moment is near zero, which amplified the drift in I4.

``optimizer_state_resets_total`` counts reports at which a reset was seen since the
previous report (several resets between two reports count once), each with an
``optimizer_state_reset`` event saying what was seen:

- the param groups changed (a group added or removed, or the parameters of a
  group changed: the optimizer was rebuilt in place, or a new stage added
  parameters; ``load_state_dict`` replacing the group dicts is not a change);
- a parameter's state vanished (``optimizer.state.clear()`` not refilled yet);
- a parameter's state tensors were recreated and its step count is at most the
  optimizer steps elapsed since the previous report (cleared, then refilled by
  the steps since), checked on the device;
- its step count went back in place below the previous report's, on the device.

The last two are decided on the sender thread (``ctx.event(when=...)``). A state
reloaded from a checkpoint (recreated, but with its old step count) is not a reset.
"""

from __future__ import annotations

import torch

from trainvitals.hooks.indices import IndexCache
from trainvitals.hooks.signals.base import MonitorView
from trainvitals.hooks.signals.optimizer.state import StateWalk
from trainvitals.hooks.signals.param_series import groups_key
from trainvitals.hooks.step import StepContext


def reset_between(before: float | None, after: float | None, elapsed: int | None) -> str | None:
    """What one parameter's step count says between two looks at the optimizer state
    (host numbers: the offline audit's form of the conditions above), or None:

    - ``after`` None (no state now, one before): the state vanished;
    - ``after < before``: the step count went back;
    - ``after <= elapsed`` (the optimizer steps between the looks, when known) while
      ``after < before + elapsed``: it restarted since the first look (cleared, then
      refilled by the steps since).

    ``before`` None: the parameter had no state at the first look (new, not reset)."""
    if before is None:
        return None
    if after is None:
        return "its optimizer state vanished"
    if after < before:
        return f"its step count went back ({before:g} -> {after:g})"
    if elapsed is not None and before > 0 and after <= elapsed and after < before + elapsed:
        return f"its step count restarted ({before:g} -> {after:g} over {elapsed} steps)"
    return None


class ResetDetector:
    """Compares each walk with the previous one; emits the counter and events."""

    def __init__(self, monitor: MonitorView, walk: StateWalk, steps: torch.Tensor | None) -> None:
        self.count = torch.zeros(1, device=monitor.device)  # 1-D: emitted as it is
        self.groups_key = groups_key(monitor)
        self.groups_params = {id(p) for g in monitor.optimizer.param_groups for p in g["params"]}
        # A state that exists at attach (a resumed run) is the baseline.
        self.steps, self.order = steps, tuple(walk.ids)
        self.report_step = monitor.step
        self._indices = IndexCache()

    def observe(self, monitor: MonitorView, ctx: StepContext, walk: StateWalk, now: torch.Tensor | None) -> None:
        dev = monitor.device
        key = groups_key(monitor)
        reasons: list[str] = []
        if key != self.groups_key:
            params = {id(p) for g in monitor.optimizer.param_groups for p in g["params"]}
            added, removed = len(params - self.groups_params), len(self.groups_params - params)
            reasons.append(
                f"param groups changed ({len(self.groups_key)} -> {len(key)} groups, "
                f"{added} parameters added, {removed} removed)"
            )
            self.groups_key, self.groups_params = key, params
        if walk.vanished:
            more = f" and {len(walk.vanished) - 3} more" if len(walk.vanished) > 3 else ""
            reasons.append(
                f"optimizer state emptied for {len(walk.vanished)} parameter(s) ({', '.join(walk.vanished[:3])}{more})"
            )
        flag = None
        elapsed = monitor.step - self.report_step
        ids = tuple(walk.ids)
        if now is not None and self.steps is not None:
            if ids == self.order and not any(walk.recreated):
                flag = (now < self.steps).any(0, keepdim=True)  # the usual case: one compare, no index
            else:
                prev_pos = {pid: j for j, pid in enumerate(self.order)}
                kept = [
                    (j, prev_pos[pid])
                    for j, (pid, rec) in enumerate(zip(ids, walk.recreated, strict=True))
                    if pid in prev_pos and not rec
                ]
                fresh = [j for j, rec in enumerate(walk.recreated) if rec]
                flag = torch.zeros(1, dtype=torch.bool, device=dev)
                if kept:
                    a = self._indices.get([j for j, _ in kept], dev)
                    b = self._indices.get([k for _, k in kept], dev)
                    flag = flag | (now[a] < self.steps[b]).any()
                if fresh:
                    flag = flag | (now[self._indices.get(fresh, dev)] <= elapsed).any()
        self.steps, self.order, self.report_step = now, ids, monitor.step
        if reasons:
            self.count = self.count + 1
            ctx.event("optimizer_state_reset", "; ".join(reasons))
        elif flag is not None:
            self.count = self.count + flag
            ctx.event(
                "optimizer_state_reset",
                f"a step count went back or restarted since step {monitor.step - elapsed} "
                "(optimizer state cleared, zeroed or rebuilt)",
                when=flag,
            )
        ctx.emit("optimizer_state_resets_total", self.count, {})
