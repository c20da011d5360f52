"""The weight-decay audit at attach: which 1D parameters get no weight decay.

Under Adam nothing pulls such a parameter back if it drifts (docs/incidents.md,
I4): one log line and a ``weight_decay_audit`` event in the first report name them.
Host only, once.
"""

from __future__ import annotations

import logging
from typing import Any

from trainvitals.hooks.signals.base import REBINDING, MonitorView

log = logging.getLogger("trainvitals")

SHOWN = 5
"""Parameter names spelled out in the message; the rest are counted."""


def decays(weight_decay: Any) -> bool:
    """Whether a param group's ``weight_decay`` (absent: 0) decays its parameters."""
    return weight_decay is not None and float(weight_decay) != 0.0


def weight_decay_message(one_d: list[tuple[str, bool]]) -> tuple[list[str], str]:
    """The 1D parameters (name, whether it decays) without weight decay, sorted, and
    the audit's one line about them."""
    none = sorted(name for name, decayed in one_d if not decayed)
    msg = f"weight-decay audit: {len(none)} of {len(one_d)} 1D parameters get no weight decay"
    if none:
        shown = ", ".join(none[:SHOWN])
        more = f" and {len(none) - SHOWN} more" if len(none) > SHOWN else ""
        msg += f": {shown}{more} (under Adam, nothing pulls them back if they drift; docs/incidents.md, I4)"
    return none, msg


def audit_weight_decay(monitor: MonitorView) -> str:
    """Log and queue the audit; return its message."""
    one_d: list[tuple[str, bool]] = []
    for label, group in monitor.groups():
        decayed = decays(group.get("weight_decay", 0.0))  # attach time, not the training step
        for i, p in enumerate(group["params"]):
            if p.ndim <= 1:
                one_d.append((monitor.name_of(p, f"{label}.{i}"), decayed))
    _, msg = weight_decay_message(one_d)
    if not REBINDING.get():  # said once, at attach: a live settings change does not repeat it
        log.info("trainvitals: %s", msg)
    monitor.event("weight_decay_audit", msg, {})
    return msg
