"""The weight-decay audit at attach: which 1D parameters get no weight decay.

Under Adam nothing pulls such a parameter back if it drifts (docs/incidents.md,
I4): one log line and a ``weight_decay_audit`` event in the first report name them.
Host only, once.
"""

from __future__ import annotations

import logging

from trainvitals.hooks.signals.base import REBINDING, MonitorView

log = logging.getLogger("trainvitals")

SHOWN = 5
"""Parameter names spelled out in the message; the rest are counted."""


def audit_weight_decay(monitor: MonitorView) -> str:
    """Log and queue the audit; return its message."""
    one_d: list[tuple[str, bool]] = []
    for label, group in monitor.groups():
        wd = group.get("weight_decay", 0.0)
        decays = bool(float(wd) != 0.0)  # attach time, not the training step
        for i, p in enumerate(group["params"]):
            if p.ndim <= 1:
                one_d.append((monitor.name_of(p, f"{label}.{i}"), decays))
    none = sorted(name for name, decays in one_d if not decays)
    msg = f"weight-decay audit: {len(none)} of {len(one_d)} 1D parameters get no weight decay"
    if none:
        shown = ", ".join(none[:SHOWN])
        more = f" and {len(none) - SHOWN} more" if len(none) > SHOWN else ""
        msg += f": {shown}{more} (under Adam, nothing pulls them back if they drift; docs/incidents.md, I4)"
    if not REBINDING.get():  # said once, at attach: a live settings change does not repeat it
        log.info("trainvitals: %s", msg)
    monitor.event("weight_decay_audit", msg, {})
    return msg
