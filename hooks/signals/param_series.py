"""Which parameters get their own ``param`` series (I4), shared by ParamHealth and
AdamState so both label the same parameters.

The candidates are the parameters of the optimizer's param groups (what the
optimizer can move). 1D parameters (``ndim <= 1``, scalars included) come first, in
name order; with ``attach(per_param=True)`` the parameters with ``ndim >= 2``
follow, also in name order. At most ``max_param_series`` in all; the cut is logged
once. Names are the clean ``named_parameters()`` names of the unwrapped model; a
parameter the model does not own is named after its group and position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainvitals.hooks.signals.base import MonitorView


@dataclass(frozen=True, eq=False)
class Series:
    name: str
    param: torch.Tensor
    group: int  # index into optimizer.param_groups


def groups_key(monitor: MonitorView) -> tuple:
    """Which parameters each param group holds, by identity (host only).

    Changes when a group is added or removed or its parameters change; not when
    ``load_state_dict`` replaces the group dicts with the same parameters."""
    return tuple(tuple(map(id, g["params"])) for g in monitor.optimizer.param_groups)


def choose(monitor: MonitorView) -> list[Series]:
    """The parameters reported individually, in report order."""
    one_d: list[Series] = []
    multi: list[Series] = []
    for gi, (label, group) in enumerate(monitor.groups()):
        for i, p in enumerate(group["params"]):
            s = Series(monitor.name_of(p, f"{label}.{i}"), p, gi)
            (one_d if p.ndim <= 1 else multi).append(s)
    one_d.sort(key=lambda s: s.name)
    cap = monitor.config.max_param_series
    chosen = one_d[:cap]
    if len(one_d) > cap:
        monitor.warn_once(
            "param_series_cap_1d",
            "%d 1D parameters but max_param_series=%d: per-parameter series for the "
            "first %d by name only; raise max_param_series to see all",
            len(one_d),
            cap,
            cap,
        )
    if monitor.config.per_param:
        multi.sort(key=lambda s: s.name)
        room = cap - len(chosen)
        chosen += multi[:room]
        if len(multi) > room:
            monitor.warn_once(
                "param_series_cap_2d",
                "per_param=True: %d parameters with ndim >= 2 but only %d series left "
                "under max_param_series=%d; the rest are reported per group only",
                len(multi),
                room,
                cap,
            )
    return chosen
