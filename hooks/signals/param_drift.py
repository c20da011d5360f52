"""The drift state of the 1D parameters that have a series: their elements end to
end, the reference each drift is measured from, and the ring of change signs behind
``param_drift_consistency_ratio`` (docs/signals.md, "1D parameters").

Consistency: per element, the signs of its changes between consecutive reports
(+1, -1, 0 when unchanged) over the last ``drift_window`` reports; |mean sign| per
element, averaged over the elements (at most :data:`CONSISTENCY_SAMPLE` per
parameter, a deterministic strided sample beyond that). Kept as an int8 ring and
running int32 sums on the device: one subtraction and one add per report.
"""

from __future__ import annotations

import torch

from trainvitals.hooks.sampling import StridedSample, owner_index
from trainvitals.hooks.signals.base import MonitorView
from trainvitals.hooks.signals.param_series import Series
from trainvitals.hooks.tensors import flat, local

CONSISTENCY_SAMPLE = 1024
"""Elements per parameter whose change signs are kept."""


def absmax_reference(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A parameter's absmax as a 0-d float32 tensor on ``device`` (0 for an empty one)."""
    v = flat(local(p).detach())
    return v.abs().amax().to(device, torch.float32) if v.numel() else torch.zeros((), device=device)


class DriftTracker:
    """One arrangement of the series' 1D parameters and their change-sign ring."""

    def __init__(self, monitor: MonitorView, series: list[Series], refs: dict[int, torch.Tensor]):
        dev = monitor.device
        self.series = series
        self.one_d = [s for s in series if s.param.ndim <= 1]
        self.labels = [{"param": s.name} for s in self.one_d]
        self.n = len(self.one_d)
        # Complex parameters count as (real, imaginary) pairs, as Adam treats them.
        counts = [flat(local(s.param).detach()).numel() for s in self.one_d]
        self.owner = owner_index(counts, dev)  # element -> parameter
        self.consistency = StridedSample(counts, CONSISTENCY_SAMPLE)
        self.sampled_owner = self.owner if self.consistency.dense else self.consistency.owners(dev)
        self.sampled = torch.tensor(self.consistency.sizes, dtype=torch.float32).to(dev)
        self.ref = (torch.stack([refs[id(s.param)] for s in self.one_d]).to(dev, torch.float32)
                    if self.one_d else torch.zeros(0, device=dev))
        self.window = monitor.config.drift_window
        self.prev = self.consistency.take_from(self.values(dev)).clone()
        self.ring = torch.zeros(self.window, self.prev.numel(), dtype=torch.int8, device=dev)
        self.sums = torch.zeros(self.prev.numel(), dtype=torch.int32, device=dev)
        self.changes = 0

    def values(self, dev: torch.device) -> torch.Tensor:
        """The local elements of the 1D parameters, end to end, as float32."""
        if not self.one_d:
            return torch.zeros(0, device=dev)
        return torch.cat([flat(local(s.param).detach()).to(dev, torch.float32, non_blocking=True)
                          for s in self.one_d])

    def record_change(self, now: torch.Tensor) -> None:
        """Push sign(now - prev) of the sampled elements into the ring (NaN: no change)."""
        sign = (now > self.prev).to(torch.int8) - (now < self.prev).to(torch.int8)
        slot = self.changes % self.window
        self.sums += sign - self.ring[slot]
        self.ring[slot] = sign
        self.changes += 1
        self.prev.copy_(now)

    def mean_abs_sign(self) -> torch.Tensor:
        """Per sampled element, |mean sign| over the changes in the window."""
        return self.sums.abs().to(torch.float32) / min(self.changes, self.window)
