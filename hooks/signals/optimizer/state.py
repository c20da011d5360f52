"""One look at the optimizer's per-parameter state (host only).

Adam-family optimizers are recognized by their keys, not their class (so
subclasses, foreach and fused variants work): a param group with ``betas`` and
``eps`` and a per-parameter state with ``exp_avg``, ``exp_avg_sq`` and ``step``.
:class:`StateWalk` records, in one pass over the groups, what the reset detector
and the moment statistics both need. Identities are followed with weak references,
so a state recreated between two reports is seen without looking every step.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from trainvitals.hooks.signals.base import MonitorView


def is_adam_group(group: dict[str, Any]) -> bool:
    return "betas" in group and "eps" in group


def step_tensor(st: dict[str, Any]) -> torch.Tensor | None:
    """The state's step count as a tensor (plain optimizers keep a Python number)."""
    step = st.get("step")
    if isinstance(step, torch.Tensor):
        return step
    if isinstance(step, (int, float)):
        return torch.tensor(float(step))
    return None


def anchor(st: dict[str, Any]) -> torch.Tensor | None:
    """A tensor of the state whose identity changes when the state is recreated."""
    step = st.get("step")
    if isinstance(step, torch.Tensor):
        return step
    for v in st.values():
        if isinstance(v, torch.Tensor):
            return v
    return None


class AdamEntry:
    """One Adam-family parameter: its group index, state dict, and the second moment
    Adam divides by (``max_exp_avg_sq`` with amsgrad)."""

    __slots__ = ("group", "param", "state", "v")

    def __init__(self, param: torch.Tensor, group: int, state: dict[str, Any], v: torch.Tensor):
        self.param, self.group, self.state, self.v = param, group, state, v


# id(param) -> (weakref to the param, weakref to its state's anchor tensor)
Anchors = dict[int, tuple[Any, Any]]


class StateWalk:
    """What one walk over the optimizer's state saw."""

    def __init__(self, monitor: MonitorView, previous: Anchors) -> None:
        self.vanished: list[str] = []  # parameters whose state is gone since the last look
        self.ids: list[int] = []  # parameters with a step count, and their step tensors
        self.steps: list[torch.Tensor] = []
        self.recreated: list[bool] = []  # state tensors replaced since the last look
        self.entries: list[AdamEntry] = []  # Adam-family parameters
        self.entry_steps: list[int] = []  # their positions in ``steps``
        self.anchors: Anchors = {}
        # What the walk's outcome depends on, to see at the next report by identities
        # alone that a new walk would find the same (see ``unchanged``); None when a
        # step count is a plain number (a new tensor at every walk) or a look found a
        # change (vanished or recreated states are reported once, by a full walk).
        self.flags = group_flags(monitor)
        checks: list[tuple[Any, ...]] | None = []
        state = monitor.optimizer.state
        for gi, (label, group) in enumerate(monitor.groups()):
            adam, amsgrad = self.flags[gi]
            for i, p in enumerate(group["params"]):
                st = state.get(p)  # .get: optimizer.state is a defaultdict
                if checks is not None:
                    checks.append(_check(p, st))
                old = previous.get(id(p))
                if old is not None and old[0]() is not p:
                    old = None  # the id now belongs to another parameter
                a = anchor(st) if st else None
                if st is None or a is None:  # (no anchor without a state)
                    if old is not None:
                        self.vanished.append(monitor.name_of(p, f"{label}.{i}"))
                    continue
                same = old is not None and old[1]() is a
                self.anchors[id(p)] = old if old is not None and same else (weakref.ref(p), weakref.ref(a))
                step = step_tensor(st)
                if step is None:
                    continue
                if adam and "exp_avg" in st and "exp_avg_sq" in st:
                    v = st["max_exp_avg_sq"] if amsgrad and "max_exp_avg_sq" in st else st["exp_avg_sq"]
                    self.entries.append(AdamEntry(p, gi, st, v))
                    self.entry_steps.append(len(self.steps))
                self.ids.append(id(p))
                self.steps.append(step)
                self.recreated.append(old is not None and not same)
                if step is not st.get("step"):
                    checks = None
        if self.vanished or any(self.recreated):
            checks = None
        self.checks = checks

    def unchanged(self, monitor: MonitorView) -> bool:
        """True when a new walk would see what this one saw: the same groups and
        flags, and per parameter the same state dict holding the same step and
        moment tensors (``groups_key`` is compared by the caller)."""
        checks = self.checks
        if checks is None or group_flags(monitor) != self.flags:
            return False
        state = monitor.optimizer.state
        for p, st, n, a, m, v, vmax in checks:
            if state.get(p) is not st:
                return False
            if st is not None and (
                len(st) != n
                or anchor(st) is not a
                or st.get("exp_avg") is not m
                or st.get("exp_avg_sq") is not v
                or st.get("max_exp_avg_sq") is not vmax
            ):
                return False
        return True


def group_flags(monitor: MonitorView) -> tuple[tuple[bool, bool], ...]:
    """(Adam-family, amsgrad) of each param group."""
    flags = []
    for g in monitor.optimizer.param_groups:
        adam = is_adam_group(g)
        flags.append((adam, adam and bool(g.get("amsgrad", False))))
    return tuple(flags)


def _check(p: torch.Tensor, st: dict[str, Any] | None) -> tuple[Any, ...]:
    """What one parameter's state is made of, compared by identity in ``unchanged``."""
    if st is None:
        return (p, None, 0, None, None, None, None)
    return (p, st, len(st), anchor(st), st.get("exp_avg"), st.get("exp_avg_sq"), st.get("max_exp_avg_sq"))


def stack_steps(tensors: list[torch.Tensor], dev: torch.device) -> torch.Tensor:
    """Stack 0-d step tensors onto ``dev``: one stack where they live, one copy."""
    first = tensors[0].device
    if all(t.device == first for t in tensors):
        return torch.stack(tensors).to(dev, non_blocking=True)
    return torch.stack([t.to(dev, non_blocking=True) for t in tensors])
