"""Which parameters get their own ``param`` series (I4), shared by ParamHealth and
AdamState so both label the same parameters.

The candidates are the parameters of the optimizer's param groups (what the
optimizer can move). 1D parameters (``ndim <= 1``, scalars included) come first, in
name order; with ``attach(per_param=True)`` the parameters with ``ndim >= 2``
follow, also in name order. At most ``max_param_series`` in all (a series is a
reference copy kept in the job and about eight samples in every report); the cut is
logged once and sent as a ``param_series_cut`` event in the next report, naming how
many parameters are left without their own series (the per-group optimizer and Adam
figures still include them; their drift is not tracked). Names are the clean
``named_parameters()`` names of the unwrapped model; a parameter the model does not
own is named after its group and position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainvitals.hooks.signals.base import MonitorView
from trainvitals.wire.schema import MAX_DETAIL


@dataclass(frozen=True, eq=False)
class Series:
    name: str
    param: torch.Tensor
    group: int  # index into optimizer.param_groups


def groups_key(monitor: MonitorView) -> tuple[Any, ...]:
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
    if len(one_d) > cap and monitor.warn_once(
        "param_series_cap_1d",
        "%d 1D parameters but max_param_series=%d: per-parameter series for the "
        "first %d by name only; raise max_param_series to see all",
        len(one_d),
        cap,
        cap,
    ):
        _report_cut(monitor, one_d[cap:], len(one_d), cap, "1D parameters")
    if monitor.config.per_param:
        multi.sort(key=lambda s: s.name)
        room = cap - len(chosen)
        chosen += multi[:room]
        if len(multi) > room and monitor.warn_once(
            "param_series_cap_2d",
            "per_param=True: %d parameters with ndim >= 2 but only %d series left "
            "under max_param_series=%d; the rest are reported per group only",
            len(multi),
            room,
            cap,
        ):
            _report_cut(monitor, multi[max(room, 0) :], len(multi), max(room, 0), "parameters with ndim >= 2")
    return chosen


def _report_cut(monitor: MonitorView, left_out: list[Series], total: int, kept: int, what: str) -> None:
    """The cut in the next report too (a ``param_series_cut`` event), not only in the
    job's log: whoever reads the run can tell the parameters watched one by one from
    those that are not, and which ones (the first few by name)."""
    names = ", ".join(s.name for s in left_out[:_NAMED])
    more = f" and {len(left_out) - _NAMED} more" if len(left_out) > _NAMED else ""
    monitor.event(
        "param_series_cut",
        f"{kept} of {total} {what} have their own series (max_param_series="
        f"{monitor.config.max_param_series}); without: {names}{more}"[:MAX_DETAIL],
    )


_NAMED = 8  # names listed in the event's detail
